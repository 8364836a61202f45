"""Whole server-sent events out of a stream's chunks, however the reads cut them."""

from __future__ import annotations

from collections.abc import Callable

END = b"\n\n"  # what ends an event (vLLM writes no other line ending)
END_SIZE = len(END)  # `chunk[-END_SIZE:] == END`: endswith's argument parsing costs more


class Events:
    """Keeps the start of an event whose end has not arrived, until it does."""

    __slots__ = ("partial",)

    def __init__(self) -> None:
        self.partial = b""

    def whole(self, chunk: bytes) -> bytes:
        """The whole events the chunk completes, as they came; the start of the next is kept."""
        if self.partial:
            chunk, self.partial = self.partial + chunk, b""
        if chunk.endswith(END):  # a read that ends where an event does: the common case
            return chunk
        cut = chunk.rfind(END) + len(END)
        if cut < len(END):
            self.partial = chunk
            return b""
        self.partial = chunk[cut:]
        return chunk[:cut]

    def each(self, chunk: bytes, event: Callable[[bytes], bytes]) -> bytes:
        """`event` applied to each whole event the chunk completes, the results joined."""
        return per_event(self.whole(chunk), event)


def per_event(events: bytes, event: Callable[[bytes], bytes]) -> bytes:
    """`event` applied to each of these whole events, the results joined."""
    return b"".join(event(one + END) for one in events.split(END)[:-1])
