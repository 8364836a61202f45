"""The service's state directory (the unit's WorkingDirectory, HOME, cache and only writable
path) is the service user's, and so is everything in it but the model: a run as root once left
a 0700 directory there that the service could not enter, and nothing repaired it.

Judged from permission bits, as the access check is, so that root can check for the service.
"""

from __future__ import annotations

import stat
from pathlib import Path

from appliance.core.sections import SYSTEM_STATE
from supervisor.doctor.access import SERVICE_USER, allowed
from supervisor.doctor.box import Account, Box
from supervisor.doctor.report import Finding, blocker, ok, skip, warning

CHECK = "state"
ROOTS_OWN = frozenset({"models"})  # install.sh keeps the model root's: the service only reads it
MAX_ENTRIES = 256  # what is listed of the state directory; an install holds a handful


def check_state_dir(box: Box, account: Account | None, state: Path = SYSTEM_STATE) -> Finding:
    """account: whose use is judged; only the service user's state is checked."""
    if account is None or account.name != SERVICE_USER:
        return skip(CHECK, f"{state} is checked for the service user ({SERVICE_USER}) only")
    try:
        box.stat(state)
    except OSError:
        return skip(CHECK, f"{state} absent: no system install here")
    mend = f"run install.sh --system again (it gives them back to {SERVICE_USER})"
    if allowed(box, account, state, "rwx") is not None:
        return blocker(CHECK, f"{account.name} cannot write its state directory {state}",
                       f"{mend}, or: chown {SERVICE_USER}:{SERVICE_USER} {state} && "
                       f"chmod 0750 {state}")
    refused = [str(entry) for entry in _entries(box, state) if not _usable(box, account, entry)]
    if refused:
        return warning(CHECK, f"{account.name} cannot use {', '.join(refused)} in its state "
                       "directory (left by a run as another user?)",
                       f"{mend}, or: chown -R {SERVICE_USER}:{SERVICE_USER} {' '.join(refused)}")
    return ok(CHECK, f"{account.name} owns what it uses in {state}")


def _entries(box: Box, state: Path) -> list[Path]:
    try:
        names = sorted(entry.name for entry in box.path(state).iterdir())
    except OSError:
        return []
    return [state / name for name in names[:MAX_ENTRIES] if name not in ROOTS_OWN]


def _usable(box: Box, account: Account, path: Path) -> bool:
    """A directory to enter and write in, a file to read and write; a link is the install's."""
    try:
        mode = box.lstat(path).st_mode
    except OSError:
        return True  # gone since it was listed
    if stat.S_ISLNK(mode):
        return True
    return allowed(box, account, path, "rwx" if stat.S_ISDIR(mode) else "rw") is None
