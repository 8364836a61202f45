"""The service user can use what it starts from: both interpreters (the real files behind the
venvs' links: a pyenv build in root's home is not), the engine venv, the model, the config.

Judged from permission bits along each path, so that root can check it for another user
without switching to it; ACLs are not read (an ACL that grants more is then reported refused).
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

from appliance.core.catalog import Catalog
from appliance.core.settings import Settings, config_path
from supervisor.doctor.box import Account, Box
from supervisor.doctor.report import Finding, blocker, ok

CHECK = "access"
SERVICE_USER = "chat-appliance"
_BITS = {"r": (stat.S_IRUSR, stat.S_IRGRP, stat.S_IROTH),
         "w": (stat.S_IWUSR, stat.S_IWGRP, stat.S_IWOTH),
         "x": (stat.S_IXUSR, stat.S_IXGRP, stat.S_IXOTH)}


def allowed(box: Box, account: Account, path: Path, want: str) -> str | None:
    """None if account may `want` ("r", "rx", ...) path, else the first path that refuses."""
    resolved = path.resolve()
    for ancestor in [*reversed(resolved.parents), resolved]:
        need = want if ancestor == resolved else "x"
        try:
            info = box.stat(ancestor)
        except OSError:
            return f"{ancestor} (missing)"
        if not all(_may(info, account, bit) for bit in need):
            return str(ancestor)
    return None


def _may(info: os.stat_result, account: Account, bit: str) -> bool:
    mode = info.st_mode
    user, group, other = _BITS[bit]
    if account.uid == 0:  # root reads and writes anything; executes what anyone may
        return bit != "x" or bool(mode & (user | group | other)) or stat.S_ISDIR(mode)
    if info.st_uid == account.uid:
        return bool(mode & user)
    if info.st_gid in account.gids:
        return bool(mode & group)
    return bool(mode & other)


def wanted_paths(settings: Settings, app_python: Path) -> list[tuple[str, Path, str]]:
    """(what, path, access) the service needs: every model of the catalog's directory."""
    engine_python = settings.engine.python
    wanted = [
        ("appliance interpreter", app_python.resolve(), "rx"),
        ("appliance venv", app_python.parent.parent / "lib", "rx"),
        ("engine interpreter", engine_python.resolve(), "rx"),
        ("engine interpreter's library", engine_python.resolve().parent.parent / "lib", "rx"),
        ("engine venv", engine_python.parent.parent / "lib", "rx"),
    ]
    models = Catalog.from_settings(settings).entries
    for entry in models:
        what, model = "model" if len(models) == 1 else f"model {entry.name}", Path(entry.engine.model)
        wanted += [(what, model / "config.json", "r"),
                   *((f"{what} weights", weights, "r")
                     for weights in sorted(model.glob("*.safetensors")))]
    config = config_path()
    if config is not None:
        wanted.append(("config", config, "r"))
    return wanted


def service_account(box: Box, user: str | None) -> Account | None:
    """The named user; by default the service user when root runs this and it exists (the
    install checks on its behalf), else whoever runs this (serve under systemd: the service)."""
    if user is None:
        me = box.account(None)
        if me is not None and me.uid == 0:
            return box.account(SERVICE_USER) or me
        return me
    return box.account(user)


def check_access(box: Box, settings: Settings, account: Account | None,
                 app_python: Path = Path(sys.executable), missing_ok: bool = False) -> Finding:
    """account: whose access (None: the user asked for does not exist)."""
    if account is None:
        return blocker(CHECK, "no such user", "create it (install.sh --system) or pass --user")
    refused = []
    for what, path, want in wanted_paths(settings, app_python):
        where = allowed(box, account, path, want)
        if where is not None and not (missing_ok and where.endswith("(missing)")):
            refused.append(f"{what} ({where})")
    if refused:
        return blocker(CHECK, f"{account.name} cannot use: {'; '.join(refused)}",
                       "use a system-wide Python (CHAT_APPLIANCE_PYTHON=/usr/bin/python3.11) and "
                       "paths the service user can read, then run install.sh again")
    models = "models" if settings.models else "model"
    return ok(CHECK, f"{account.name} can use both interpreters, the venvs, the {models}, the config")
