"""TLS on the API port: one server context for the life of the process, its certificate
re-read in place on reload.

The listening socket keeps the context it was given; `load_cert_chain` on that same context
changes what each new handshake presents, so a rotated certificate is served without a restart
(connections already open keep theirs). A pair is first loaded into a scratch context: a key
that does not match its certificate is refused before the live context is touched.
"""

from __future__ import annotations

import hashlib
import re
import ssl
from pathlib import Path

import structlog

from appliance.core.sections import ServerSettings
from appliance.core.settings import ConfigError

log = structlog.get_logger("supervisor.operator.tls")

_PEM_CERT = re.compile(r"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.DOTALL)


class ServerTls:
    """The API's server-side TLS context and the files it was loaded from."""

    def __init__(self, certfile: Path, keyfile: Path) -> None:
        self.context = _context()
        self.certfile, self.keyfile = certfile, keyfile
        _load(self.context, certfile, keyfile)
        self.fingerprint = fingerprint(certfile)

    @classmethod
    def from_settings(cls, server: ServerSettings) -> ServerTls | None:
        """None where TLS is off; ConfigError naming the setting where the pair cannot serve."""
        if server.tls_certfile is None or server.tls_keyfile is None:
            return None
        return cls(server.tls_certfile, server.tls_keyfile)

    def check(self, server: ServerSettings) -> None:
        """The pair in `server` would load (ConfigError if not); nothing in force changes."""
        if server.tls_certfile is None or server.tls_keyfile is None:
            raise ConfigError("server.tls_certfile: TLS cannot be turned off by a reload; "
                              "restart to serve plain HTTP")
        _load(_context(), server.tls_certfile, server.tls_keyfile)

    def rotate(self, server: ServerSettings) -> str:
        """Load the pair in `server` (already `check`ed) into the live context; new handshakes
        present it. Returns its SHA-256 fingerprint."""
        assert server.tls_certfile is not None and server.tls_keyfile is not None
        _load(self.context, server.tls_certfile, server.tls_keyfile)
        self.certfile, self.keyfile = server.tls_certfile, server.tls_keyfile
        previous, self.fingerprint = self.fingerprint, fingerprint(server.tls_certfile)
        log.info("tls.reloaded", certfile=str(self.certfile), fingerprint=self.fingerprint,
                 changed=previous != self.fingerprint)
        return self.fingerprint


def _context() -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["http/1.1"])  # the API speaks HTTP/1.1 only
    return context


def _load(context: ssl.SSLContext, certfile: Path, keyfile: Path) -> None:
    try:
        context.load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError) as exc:
        reason = getattr(exc, "strerror", None) or getattr(exc, "reason", None) or str(exc)
        raise ConfigError(f"server.tls_certfile/tls_keyfile: cannot load {certfile} with "
                          f"{keyfile}: {reason}") from exc


def fingerprint(certfile: Path) -> str:
    """SHA-256 of the (first) certificate, as `openssl x509 -fingerprint -sha256` prints it."""
    match = _PEM_CERT.search(certfile.read_text())
    if match is None:
        raise ConfigError(f"server.tls_certfile: {certfile} holds no PEM certificate")
    digest = hashlib.sha256(ssl.PEM_cert_to_DER_cert(match.group())).hexdigest().upper()
    return ":".join(digest[i:i + 2] for i in range(0, len(digest), 2))
