"""Self-signed certificates for tests, made with the openssl command install.sh uses too."""

from __future__ import annotations

import hashlib
import ssl
import subprocess
from pathlib import Path


def self_signed(directory: Path, name: str = "appliance",
                names: tuple[str, ...] = ("DNS:localhost", "IP:127.0.0.1")) -> tuple[Path, Path]:
    """(certificate, key) PEM files in `directory`, valid for `names` (subjectAltName)."""
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2", "-subj", f"/CN={name}",
                    "-addext", f"subjectAltName={','.join(names)}", "-keyout", str(key),
                    "-out", str(cert)], check=True, capture_output=True, timeout=60)
    return cert, key


def der_sha256(certfile: Path) -> str:
    """The certificate's SHA-256, as hex: what a server presenting it hands over."""
    return hashlib.sha256(ssl.PEM_cert_to_DER_cert(certfile.read_text())).hexdigest()
