"""Which `Host` the appliance answers: its own names and addresses, and those it is told.

A web page cannot read another site's answers, unless that site's name is made to point at
the appliance (DNS rebinding): the browser then sends the page's requests, and lets it read
the answers, with the attacker's name in `Host`. An appliance with no keys (the development
default) would serve any page on the LAN that way. So every route, before anything runs for
the request, answers a `Host` it does not know `421 Misdirected Request` in its error shape.

Known by default: loopback names (`localhost`, `*.localhost`) and addresses, the machine's
hostname, FQDN and mDNS name (`<hostname>.local`), the addresses of its interfaces (re-read
when an unknown address comes, so a new DHCP lease is known at once), and the bind address
when it is a specific one; a port in `Host` is ignored. `server.allowed_hosts` adds names (a
fleet's name, a NAT's public address); `"*"` there answers every `Host` (behind a router that
rewrites it, which then carries this check). A request with no `Host` at all (HTTP/1.0 probes)
is answered: every browser sends one.
"""

from __future__ import annotations

import functools
import ipaddress
import socket
from collections.abc import Callable, Iterable

import psutil

from appliance.core.errors import ApiError, MisdirectedRequest
from appliance.core.sections import ServerSettings

ANY = "*"
_FAMILIES = (socket.AF_INET, socket.AF_INET6)
_KNOWN_KEPT = 64  # Host values found allowed, remembered so the next ones cost a dict look-up

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


class AllowedHosts:
    """The Host values this appliance answers (see the module's docstring)."""

    def __init__(self, server: ServerSettings, *,
                 machine_names: Callable[[], Iterable[str]] | None = None,
                 interface_addresses: Callable[[], Iterable[str]] | None = None) -> None:
        names = set(server.allowed_hosts)  # lower-case, no port, no brackets (the setting)
        self._any = ANY in names
        names.update(machine_names() if machine_names is not None else _machine_names())
        if server.host not in ("0.0.0.0", "::", ""):
            names.add(server.host.lower())
        self._addresses = {a for a in map(_address, names) if a is not None}
        self._names = {n for n in names if _address(n) is None}
        self._read_interfaces = interface_addresses or _interface_addresses
        self._interfaces = self._interface_set()
        self._known: dict[bytes, None] = {}

    def allows(self, host: bytes | None) -> bool:
        """Whether a request with this `Host` header (None: none sent) is answered."""
        if host is None or self._any or host in self._known:
            return True
        found = self._allowed(host)
        if found:
            if len(self._known) >= _KNOWN_KEPT:
                self._known.clear()
            self._known[host] = None
        return found

    def _allowed(self, host: bytes) -> bool:
        name = _host_name(host)
        if name is None:
            return False
        address = _address(name)
        if address is None:
            return name in self._names or name == "localhost" or name.endswith(".localhost")
        if address.is_loopback or address in self._addresses or address in self._interfaces:
            return True
        self._interfaces = self._interface_set()  # an address this machine was given since?
        return address in self._interfaces

    def _interface_set(self) -> set[Address]:
        return {a for a in map(_address, self._read_interfaces()) if a is not None}


def misdirected(host: bytes | None) -> ApiError:
    shown = (host or b"").decode("latin-1")[:100]
    return MisdirectedRequest(
        f"this appliance does not answer for the host {shown!r}; use its own name or address, "
        "or have its operator add the name to server.allowed_hosts",
        code="host_not_allowed", reason="host_not_allowed")


def _host_name(host: bytes) -> str | None:
    """The name or address in a Host value, lower-case, without its port or trailing dot;
    None if it is no host at all."""
    try:
        text = host.decode("ascii").strip().lower()
    except UnicodeDecodeError:
        return None
    if text.startswith("["):  # [v6] or [v6]:port
        end = text.find("]")
        rest = text[end + 1:] if end > 0 else "x"
        if rest and not (rest.startswith(":") and rest[1:].isdigit()):
            return None
        return text[1:end]
    name, colon, port = text.partition(":")
    if colon and not port.isdigit():
        return None
    name = name.rstrip(".")
    return name or None


def _address(name: str) -> Address | None:
    try:
        return ipaddress.ip_address(name.split("%", 1)[0])  # a v6 address's zone is no part
    except ValueError:
        return None


@functools.cache
def _machine_names() -> frozenset[str]:
    """This machine's hostname, FQDN and mDNS name (read once: getfqdn may ask the resolver)."""
    hostname = socket.gethostname().lower().rstrip(".")
    names = {hostname, socket.getfqdn(hostname).lower().rstrip("."), f"{hostname}.local"}
    return frozenset(name for name in names if name)


def _interface_addresses() -> list[str]:
    return [entry.address for entries in psutil.net_if_addrs().values() for entry in entries
            if entry.family in _FAMILIES]
