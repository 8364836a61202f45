"""Whole server-sent events out of a stream's chunks, however the reads cut them."""

from __future__ import annotations

from collections.abc import Callable

END = b"\n\n"  # what ends an event (vLLM writes no other line ending)


class Events:
    """Keeps the start of an event whose end has not arrived, until it does."""

    __slots__ = ("partial",)

    def __init__(self) -> None:
        self.partial = b""

    def each(self, chunk: bytes, event: Callable[[bytes], bytes]) -> bytes:
        """`event` applied to each whole event the chunk completes, the results joined."""
        data = self.partial + chunk
        cut = data.rfind(END) + len(END)
        if cut < len(END):
            self.partial = data
            return b""
        self.partial = data[cut:]
        return b"".join(event(one + END) for one in data[:cut].split(END)[:-1])
