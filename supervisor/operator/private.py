"""Files and directories the supervisor makes: the service user's alone, whatever the umask.

What it writes names clients, request ids and fingerprints, and holds the worker's log lines
and stacks (crash bundles), or reaches the worker and the operator's actions (sockets): no
other local user may read it. A directory it makes is 0700 (each one it has to make on the way
too: `mkdir(parents=True)` would give those the umask's mode); a file it writes is 0600 from
the moment it exists, so the directory it lands in (an operator's, 0755) does not matter.
A directory that already exists is left as it is: it is not ours to change.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

DIR_MODE = 0o700
FILE_MODE = 0o600


def private_dir(path: Path) -> None:
    """Makes `path` and any of its missing parents, each mode 0700."""
    missing: list[Path] = []
    for directory in (path, *path.parents):
        if directory.is_dir():
            break
        missing.append(directory)
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):  # made meanwhile by someone else: theirs
            directory.mkdir(mode=DIR_MODE)
            os.chmod(directory, DIR_MODE)  # mkdir's mode passes through the umask


def write_private(path: Path, data: bytes) -> None:
    """Writes `path` whole or not at all (a temporary file renamed into place), mode 0600; its
    directory is made if missing (`private_dir`)."""
    private_dir(path.parent)
    # mkstemp makes the file 0600 itself (O_EXCL: never a file planted under its name); the
    # fchmod makes it exactly that under a umask that would take the owner's bits too.
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            os.fchmod(out.fileno(), FILE_MODE)
            out.write(data)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
