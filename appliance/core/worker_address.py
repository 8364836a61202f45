"""Where the worker listens, as the worker client connects to it: a Unix socket or loopback TCP.

Written as a URL so that one string travels from the settings through the engine view:
`http+unix://<percent-encoded socket path>` (the form Docker's and requests' Unix-socket
clients read) or `http://host:port`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import unquote, urlsplit

UNIX_SCHEME = "http+unix"

P = TypeVar("P", bound=asyncio.BaseProtocol)


@dataclass(frozen=True)
class WorkerAddress:
    """A Unix socket path, or a host and port."""

    path: str | None = None
    host: str = "127.0.0.1"
    port: int = 80

    @classmethod
    def parse(cls, url: str) -> WorkerAddress:
        split = urlsplit(url)
        if split.scheme == UNIX_SCHEME:
            return cls(path=unquote(split.netloc))
        if split.scheme != "http":
            raise ValueError(f"the worker is reached over http or http+unix, not {url!r}")
        return cls(host=split.hostname or "127.0.0.1", port=split.port or 80)

    @property
    def host_header(self) -> bytes:
        """What a request's Host header says: the socket has no host, and the worker reads none."""
        return b"localhost" if self.path is not None else f"{self.host}:{self.port}".encode()

    async def connect(self, factory: Callable[[], P]) -> P:
        """A connection on the running loop, with `factory`'s protocol."""
        loop = asyncio.get_running_loop()
        if self.path is not None:
            _, protocol = await loop.create_unix_connection(factory, self.path)
        else:  # asyncio turns Nagle off on TCP: small requests leave at once
            _, protocol = await loop.create_connection(factory, self.host, self.port)
        return protocol

    def __str__(self) -> str:
        return f"unix:{self.path}" if self.path is not None else f"{self.host}:{self.port}"

