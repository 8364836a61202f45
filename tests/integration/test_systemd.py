"""The installed unit under a real systemd: systemd as PID 1 of its own namespaces on this machine.

`install.sh --system` runs inside the namespaces (its writes to /etc, /opt, /var/lib and /var/log
land in overlays that vanish with them), then systemd boots a target of this test's own and
`systemctl` drives the installed unit: start returns on READY, /health reaches 200, STATUS is
set, a chat is answered, the worker runs as the service user, reload works, a SIGSTOPped
supervisor is killed by the watchdog and restarted, stop drains and leaves nothing behind.

The box is one an operator has debugged on (issue 37): a `serve` as root once left
/var/lib/chat-appliance/run (root, 0700) in the state directory before the install, and after
the install the operator runs the installed `serve` as root again. `systemctl reload` must
still reach the service's control socket, which lives in the unit's RuntimeDirectory, and an
operator's `chat-appliance reload` from a root shell too.

What must never happen, and how it is prevented (each measured in this project):
- A namespaced systemd that reaches sysinit.target runs `systemd-tmpfiles --remove`, which would
  empty the host's /tmp. /tmp, /var/tmp and /run are private tmpfs mounted before systemd is
  exec'd (and checked to be tmpfs, or it is never exec'd); the unit gets a DefaultDependencies=no
  drop-in under /run, and sysinit.target, basic.target and the tmpfiles units are masked there.
- PIDs inside are the namespace's: the test signals them only through nsenter, never from
  outside; the namespace ends with SIGKILL of its init from outside, never `poweroff`.

Test-only differences from a real install, in a drop-in: the API on loopback at a free port,
the service's output to a file (no journald runs), ProtectHome=read-only, because this
machine's cached interpreter and engine venv (reused, not rebuilt) live under /root, which a
0755 tmpfs with only those bound in replaces inside the namespaces, and a short watchdog and
restart delay, so that the frozen supervisor's restart does not wait out the unit's 30 s.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import ssl
import subprocess
import time
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest

from appliance.core.sections import default_engine_python, default_model
from load.kit.net import free_port

ROOT = Path(__file__).resolve().parents[2]
SYSTEMD = Path("/lib/systemd/systemd")
CGROUP_ROOT = Path("/sys/fs/cgroup")
UNIT = "chat-appliance.service"
SERVICE_USER = "chat-appliance"
INSTALL_TIMEOUT_S = 600
READY_TIMEOUT_S = 240
WATCHDOG_S = 6  # the drop-in's WatchdogSec: the supervisor pings every 3 s
INSTALLED = "/opt/chat-appliance/venv/bin/chat-appliance"
# An operator's root shell: none of the unit's environment ($RUNTIME_DIRECTORY), none of pytest's.
ROOT_SHELL = ("env", "-i", "PATH=/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root")

# The installed `serve`, as root, by hand, with a stand-in worker (its control socket is the
# point, not the engine); stopped with SIGTERM inside the namespaces once it listens there.
ROOT_SERVE = r"""
"$@" >/mnt/root-serve.log 2>&1 &
pid=$!
for _ in $(seq 240); do
    grep -q control.listening /mnt/root-serve.log && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.25
done
kill -TERM "$pid" 2>/dev/null
wait "$pid"
"""

# Runs as the namespaces' first process; $CA_* come from the test. Order matters: nothing
# before the three private tmpfs may start anything that cleans.
NAMESPACE_SCRIPT = r"""
set -eu
mount --make-rprivate /
mount --bind "$CA_WORK" /mnt
# The checkout may itself be under /tmp (CI clones there): keep it in sight of the install.
mkdir -p /mnt/checkout
mount --bind "$CA_CHECKOUT" /mnt/checkout
mount -t tmpfs -o mode=1777 ca-tmp /tmp
mount -t tmpfs -o mode=1777 ca-var-tmp /var/tmp
mount -t tmpfs -o mode=755 ca-run /run
for dir in /tmp /var/tmp /run; do
    [ "$(stat -f -c %T "$dir")" = tmpfs ] || { echo "$dir is not private" >&2; exit 9; }
done
for dir in etc opt var/lib var/log; do
    over="/run/ca-overlay/$dir"
    mkdir -p "$over/upper" "$over/work"
    mount -t overlay ca-overlay -o "lowerdir=/$dir,upperdir=$over/upper,workdir=$over/work" "/$dir"
done
if [ -n "$CA_ROOT_BINDS" ]; then
    mkdir -p /run/ca-host-root
    mount --bind /root /run/ca-host-root
    mount -t tmpfs -o mode=755 ca-root /root
    # Read-only: whatever the install inside decides, the host's cached builds stay as they are.
    for path in $CA_ROOT_BINDS; do
        mkdir -p "$path"
        mount --bind "/run/ca-host-root/${path#/root/}" "$path"
        mount -o remount,bind,ro "$path"
    done
fi
# What a `serve` as root left before the control socket moved to the RuntimeDirectory: its
# socket's directory in the state directory, made as Path.mkdir(0o700, parents=True) makes it.
(umask 022; mkdir -p /var/lib/chat-appliance && mkdir -m 0700 /var/lib/chat-appliance/run)
cd /mnt/checkout
bash install.sh --system >/mnt/install.log 2>&1 ||
    { echo "install.sh failed: $?" >>/mnt/install.log; exit 1; }
mkdir -p /run/systemd/system/chat-appliance.service.d
cat >/run/systemd/system/chat-appliance.service.d/ca-test.conf <<EOF
[Unit]
DefaultDependencies=no
[Service]
Environment=CHAT_APPLIANCE_SERVER__HOST=127.0.0.1 CHAT_APPLIANCE_SERVER__PORT=$CA_PORT
Environment=CHAT_APPLIANCE_ENGINE__PORT=$CA_ENGINE_PORT CHAT_APPLIANCE_ENGINE__MAX_MODEL_LEN=2048
ProtectHome=read-only
WatchdogSec=$CA_WATCHDOG_S
RestartSec=1
StandardOutput=append:/mnt/service.log
StandardError=inherit
EOF
printf '[Unit]\nDescription=chat-appliance systemd test\nDefaultDependencies=no\n' \
    >/run/systemd/system/ca-test.target
for unit in sysinit.target basic.target local-fs.target network-online.target \
        systemd-tmpfiles-setup.service systemd-tmpfiles-setup-dev.service \
        systemd-tmpfiles-clean.service systemd-tmpfiles-clean.timer; do
    ln -sf /dev/null "/run/systemd/system/$unit"
done
exec "$CA_SYSTEMD" --system --unit=ca-test.target
"""


@dataclass
class Namespaced:
    """A systemd booted in its own namespaces; `init` is its PID as this machine sees it."""

    unshare: subprocess.Popen[bytes]
    init: int
    work: Path
    timings: dict[str, float] = field(default_factory=dict)

    def run(self, *argv: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["nsenter", "-t", str(self.init), "-a", *argv],
                              capture_output=True, text=True, timeout=timeout_s, check=False)

    def systemctl(self, *argv: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
        return self.run("systemctl", "--no-pager", *argv, timeout_s=timeout_s)

    def show(self, prop: str) -> str:
        return self.systemctl("show", "-p", prop, "--value", UNIT).stdout.strip()

    def logs(self) -> str:
        texts = []
        for name in ("install.log", "service.log", "root-serve.log"):
            path = self.work / name
            if path.exists():
                texts.append(f"--- {name} (tail)\n" + "\n".join(path.read_text().splitlines()[-40:]))
        return "\n".join(texts)


def _cached_builds() -> tuple[Path, Path, Path]:
    """The engine venv and models directory this checkout uses, and the interpreter that venv
    was made from (the install inside must use that one, or it would rebuild the venv)."""
    venv = Path(os.environ.get("CHAT_APPLIANCE_ENGINE_VENV") or default_engine_python().parents[1])
    models = Path(os.environ.get("CHAT_APPLIANCE_MODELS_DIR") or Path(default_model()).parent)
    config = (venv.resolve() / "pyvenv.cfg").read_text()
    python = next(line.split("=", 1)[1].strip() for line in config.splitlines()
                  if line.startswith("executable"))
    return venv.resolve(), models.resolve(), Path(python).resolve()


def _root_binds(venv: Path, models: Path, python: Path) -> str:
    """What of root's 0700 home the install inside must see."""
    wanted = {python.parents[1], venv.parent, models}
    return " ".join(sorted(str(p) for p in wanted if p.is_relative_to("/root")))


def _require_machine() -> None:
    missing = [tool for tool in ("unshare", "nsenter", "runuser", "useradd")
               if shutil.which(tool) is None]
    if os.geteuid() != 0 or not SYSTEMD.exists() or missing:
        pytest.skip(f"needs root, {SYSTEMD} and {missing or 'util-linux'} (.ci/run installs systemd)")


def _init_pid(unshare: subprocess.Popen[bytes]) -> int:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        children = psutil.Process(unshare.pid).children()
        if children:
            return children[0].pid
        assert unshare.poll() is None, "unshare exited at once"
        time.sleep(0.1)
    raise AssertionError("unshare started no child")


@contextmanager
def booted_systemd(work: Path, port: int, engine_port: int) -> Iterator[Namespaced]:
    venv, models, python = _cached_builds()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHAT_APPLIANCE_")} | {
        "CA_WORK": str(work), "CA_CHECKOUT": str(ROOT), "CA_SYSTEMD": str(SYSTEMD),
        "CA_PORT": str(port), "CA_ENGINE_PORT": str(engine_port), "CA_WATCHDOG_S": str(WATCHDOG_S),
        "CA_ROOT_BINDS": _root_binds(venv, models, python),
        "CHAT_APPLIANCE_ENGINE_VENV": str(venv), "CHAT_APPLIANCE_MODELS_DIR": str(models),
        "CHAT_APPLIANCE_PYTHON": str(python),
    }
    with (work / "namespace.log").open("wb") as out:
        unshare = subprocess.Popen(
            ["unshare", "--fork", "--pid", "--mount", "--mount-proc", "--cgroup", "--uts", "--ipc",
             "--propagation", "private", "--kill-child=SIGKILL", "--", "sh", "-c", NAMESPACE_SCRIPT],
            env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    cgroups_before = _cgroups()
    namespaced = Namespaced(unshare, _init_pid(unshare), work)
    try:
        _wait_booted(namespaced)
        yield namespaced
    finally:
        # The namespace's init, from outside, by the PID this machine gave it: everything inside
        # dies with it. Never a poweroff, never a signal to a PID read inside.
        with suppress(ProcessLookupError):
            os.kill(namespaced.init, signal.SIGKILL)
        unshare.wait(30)
        _remove_new_cgroups(cgroups_before)


def _cgroups() -> set[Path]:
    return {Path(folder) for folder, _, _ in os.walk(CGROUP_ROOT)}


def _remove_new_cgroups(before: set[Path]) -> None:
    """A cgroup-v1 machine shows the namespaced systemd the hierarchies' roots: the slices and
    scopes it made there outlive it, empty. Only those it made, deepest first; rmdir refuses
    any that still holds a process."""
    deadline = time.monotonic() + 10
    left = sorted(_cgroups() - before, key=lambda p: len(p.parts), reverse=True)
    while left and time.monotonic() < deadline:
        for folder in list(left):
            with suppress(OSError):
                folder.rmdir()
            if not folder.exists():
                left.remove(folder)
        time.sleep(0.2)


def _wait_booted(ns: Namespaced) -> None:
    deadline = time.monotonic() + INSTALL_TIMEOUT_S
    while time.monotonic() < deadline:
        assert ns.unshare.poll() is None, f"the namespace ended before systemd ran\n{ns.logs()}"
        if psutil.Process(ns.init).name() == "systemd":
            state = ns.systemctl("is-active", "ca-test.target", timeout_s=30).stdout.strip()
            if state == "active":
                return
        time.sleep(1)
    raise AssertionError(f"systemd did not boot its target\n{ns.logs()}")


def _installed_client(ns: Namespaced, port: int, folder: Path) -> httpx.Client:
    """A client as an operator would make one: HTTPS trusting the certificate the install made,
    with the key it generated (a system install protects /health too)."""
    config = tomllib.loads(ns.run("cat", "/etc/chat-appliance/config.toml").stdout)["server"]
    cert = folder / "installed-cert.pem"
    cert.write_text(ns.run("cat", config["tls_certfile"]).stdout)
    return httpx.Client(base_url=f"https://127.0.0.1:{port}", trust_env=False,
                        verify=ssl.create_default_context(cafile=str(cert)),
                        headers={"Authorization": f"Bearer {config['api_keys'][0]}"})


def _wait_health(client: httpx.Client, timeout_s: float) -> dict[str, object]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            response = client.get("/health", timeout=5)
            if response.status_code == 200:
                return dict(response.json())
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"/health never 200 at {client.base_url}")


def _service_processes(ns: Namespaced) -> list[str]:
    listing = ns.run("ps", "-u", SERVICE_USER, "-o", "pid=,args=").stdout
    return [line.strip() for line in listing.splitlines() if line.strip()]


def test_the_installed_unit_under_systemd(tmp_path: Path, artefacts: Path) -> None:
    _require_machine()
    port, engine_port = free_port(), free_port()
    with booted_systemd(tmp_path, port, engine_port) as ns:
        try:
            listening = _serve_as_root(ns, port, engine_port)
            with _installed_client(ns, port, tmp_path) as client:
                _exercise(ns, client, port)
            # Checked last, so that on a code that does write there the reload's failure shows.
            assert "/var/lib/chat-appliance" not in listening, listening
        finally:
            for name in ("install.log", "service.log", "namespace.log", "root-serve.log"):
                if (tmp_path / name).exists():
                    shutil.copy(tmp_path / name, artefacts / name)
            (artefacts / "timings.json").write_text(json.dumps(ns.timings, indent=2))


def _serve_as_root(ns: Namespaced, port: int, engine_port: int) -> str:
    """The operator debugging after the install: the installed `serve`, as root, on the
    service's port. Its log line saying where its control socket listens."""
    settings = ["CHAT_APPLIANCE_SERVER__HOST=127.0.0.1", f"CHAT_APPLIANCE_SERVER__PORT={port}",
                f"CHAT_APPLIANCE_ENGINE__PORT={engine_port}",
                'CHAT_APPLIANCE_ENGINE__COMMAND=["sleep", "600"]']
    result = ns.run("sh", "-c", ROOT_SERVE, "root-serve", *ROOT_SHELL, *settings,
                    INSTALLED, "serve")
    log = (ns.work / "root-serve.log").read_text()
    assert result.returncode == 0 and "control.listening" in log, f"{result.stderr}\n{log}"
    return next(line for line in log.splitlines() if "control.listening" in line)


def _state_left_to_others(ns: Namespaced) -> list[str]:
    """What in the state directory, but the model, is not the service user's."""
    found = ns.run("find", "/var/lib/chat-appliance", "-mindepth", "1", "-path",
                   "/var/lib/chat-appliance/models", "-prune", "-o", "!", "-user", SERVICE_USER,
                   "-printf", "%p %u %m\n").stdout
    return found.splitlines()


def _reloads(ns: Namespaced, port: int) -> None:
    """systemctl reload (ExecReload, with the unit's $RUNTIME_DIRECTORY) and an operator's
    `chat-appliance reload` from a root shell (without it) reach the service's socket."""
    reload = ns.systemctl("reload", UNIT)
    assert reload.returncode == 0, f"{reload.stderr}\n{ns.logs()}"
    by_hand = ns.run(*ROOT_SHELL, f"CHAT_APPLIANCE_SERVER__PORT={port}", INSTALLED, "reload")
    assert by_hand.returncode == 0 and by_hand.stdout.startswith("reloaded:"), by_hand.stderr


def _exercise(ns: Namespaced, client: httpx.Client, port: int) -> None:
    # start returns on READY=1 (the API listens), before the model is loaded.
    started = time.monotonic()
    result = ns.systemctl("start", UNIT, timeout_s=READY_TIMEOUT_S)
    assert result.returncode == 0, f"{result.stderr}\n{ns.logs()}"
    ns.timings["start_returned_s"] = round(time.monotonic() - started, 1)
    assert ns.show("ActiveState") == "active"
    health = _wait_health(client, READY_TIMEOUT_S)
    ns.timings["start_to_health_200_s"] = round(time.monotonic() - started, 1)
    assert health["state"] == "ready"
    assert "engine ready" in ns.show("StatusText")

    chat = client.post("/v1/chat/completions", timeout=120,
                       json={"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8})
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["content"]
    worker = ns.run("ps", "-o", "user=", "-p", str(health["pid"])).stdout.strip()
    assert worker == SERVICE_USER, f"the worker (pid {health['pid']} inside) runs as {worker!r}"

    _reloads(ns, port)
    assert _state_left_to_others(ns) == []
    assert "control.unavailable" not in (ns.work / "service.log").read_text()
    _watchdog_restart(ns, client)
    _reloads(ns, port)  # the fresh RuntimeDirectory of the new start holds the new socket

    stopping = time.monotonic()
    stop = ns.systemctl("stop", UNIT, timeout_s=120)
    ns.timings["stop_s"] = round(time.monotonic() - stopping, 1)
    assert stop.returncode == 0, stop.stderr
    ended = ns.systemctl("show", "-p", "Result", "-p", "ExecMainCode", "-p", "ExecMainStatus",
                         UNIT).stdout
    assert ns.show("ActiveState") == "inactive", ended
    assert _service_processes(ns) == [], "the service user still has processes after stop"
    assert "supervisor.drained" in (ns.work / "service.log").read_text()


def _watchdog_restart(ns: Namespaced, client: httpx.Client) -> None:
    """A frozen supervisor sends no WATCHDOG=1: systemd kills it and starts it again."""
    main_pid = ns.show("MainPID")
    frozen = time.monotonic()
    assert ns.run("kill", "-STOP", main_pid).returncode == 0
    deadline = time.monotonic() + 120
    while ns.show("MainPID") in (main_pid, "0") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ns.show("MainPID") not in (main_pid, "0"), f"not restarted\n{ns.logs()}"
    ns.timings["watchdog_restart_s"] = round(time.monotonic() - frozen, 1)
    assert ns.show("NRestarts") == "1"
    _wait_health(client, READY_TIMEOUT_S)
    ns.timings["watchdog_to_health_200_s"] = round(time.monotonic() - frozen, 1)
