"""vLLM's own test tree, taken from its sdist on PyPI once and cached; never vendored here.

The sdist cannot be built or installed without torch (its setup.py imports it first), and it
need not be: the archive is fetched by URL from the index's JSON API (PEP 691), its sha256 is
checked against the index's, and only `tests/` and the files pytest reads beside it
(`pyproject.toml` for markers, `requirements/test/` for the pinned test tools) are unpacked.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tarfile
import urllib.request
from pathlib import Path

DEFAULT_INDEX = "https://pypi.org/simple"
SIMPLE_JSON = "application/vnd.pypi.simple.v1+json"
UNPACKED = ("tests/", "pyproject.toml", "requirements/test/")
DOWNLOAD_TIMEOUT_S = 300
CHUNK_BYTES = 1 << 20


class SdistError(Exception):
    """The sdist could not be found, fetched or verified."""


def sdist_link(version: str, index: str = DEFAULT_INDEX) -> tuple[str, str]:
    """(url, sha256) of vllm-<version>.tar.gz as the index lists it."""
    request = urllib.request.Request(f"{index.rstrip('/')}/vllm/", headers={"Accept": SIMPLE_JSON})
    with urllib.request.urlopen(request, timeout=DOWNLOAD_TIMEOUT_S) as response:
        listing = json.load(response)
    name = f"vllm-{version}.tar.gz"
    for entry in listing.get("files", []):
        if entry.get("filename") == name:
            return str(entry["url"]), str(entry["hashes"]["sha256"])
    raise SdistError(f"{name} is not listed on {index}")


def download(url: str, sha256: str, dest: Path) -> Path:
    """Fetch url to dest through a temporary file; a digest mismatch leaves nothing behind."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_suffix(dest.suffix + ".part")
    digest = hashlib.sha256()
    with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as response, partial.open("wb") as out:
        while chunk := response.read(CHUNK_BYTES):
            digest.update(chunk)
            out.write(chunk)
    if digest.hexdigest() != sha256:
        partial.unlink()
        raise SdistError(f"sha256 mismatch for {url}: got {digest.hexdigest()}, index says {sha256}")
    partial.replace(dest)
    return dest


def unpack_tests(archive: Path, dest: Path) -> Path:
    """Extract the test tree (and what pytest reads beside it) into dest, atomically."""
    staging = dest.with_name(dest.name + ".part")
    shutil.rmtree(staging, ignore_errors=True)
    with tarfile.open(archive, "r:gz") as tar:
        prefix = tar.getmembers()[0].name.split("/")[0] + "/"
        members = []
        for member in tar.getmembers():
            relative = member.name.removeprefix(prefix)
            if member.isfile() and relative.startswith(UNPACKED):
                member.name = relative
                members.append(member)
        tar.extractall(staging, members=members, filter="data")
    shutil.rmtree(dest, ignore_errors=True)
    staging.replace(dest)
    return dest


def ensure_tree(cache: Path, version: str, index: str = DEFAULT_INDEX) -> Path:
    """The unpacked test tree of vLLM <version> under cache; downloads only on a cold cache."""
    tree = cache / f"vllm-{version}-tests"
    if (tree / "tests" / "utils.py").is_file():
        return tree
    archive = cache / f"vllm-{version}.tar.gz"
    if not archive.is_file():
        url, sha256 = sdist_link(version, index)
        download(url, sha256, archive)
    return unpack_tests(archive, tree)
