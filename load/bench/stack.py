"""The processes the gateway bench measures: the appliance over a synthetic upstream, and LiteLLM."""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from load.kit.processes import terminate

ROOT = Path(__file__).resolve().parents[2]
LITELLM_HOME = Path.home() / ".cache" / "chat-appliance-bench"
LITELLM_SPEC = "litellm[proxy]"
STOP_GRACE_S = 20.0


@dataclass
class Service:
    """A process we started, its log, and the pid whose CPU time is its cost."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def tail(self, lines: int = 15) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM, grace, SIGKILL: only the process we started (the appliance reaps its own)."""
        terminate(self.proc, STOP_GRACE_S)


def cpu_seconds(pid: int, children: bool = False) -> float:
    """User+system CPU seconds of a process (and, if asked, its live descendants)."""
    try:
        root = psutil.Process(pid)
        family = [root, *root.children(recursive=True)] if children else [root]
        return float(sum(p.cpu_times().user + p.cpu_times().system for p in family))
    except psutil.Error:
        return 0.0


def _spawn(name: str, argv: list[str], env: dict[str, str], workdir: Path,
           root: Path = ROOT) -> Service:
    log_path = workdir / f"{name}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root,
                                start_new_session=True)
    return Service(name, proc, log_path)


def wait_http(service: Service, url: str, timeout_s: float,
              headers: dict[str, str] | None = None, verify: ssl.SSLContext | bool = True) -> bool:
    """Poll `url` until it answers 200, the process dies, or the time is up."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and service.proc.poll() is None:
        try:
            if httpx.get(url, headers=headers, timeout=2, trust_env=False,
                         verify=verify).status_code == 200:
                return True
        except httpx.HTTPError:
            pass  # not listening yet
        time.sleep(0.25)
    return False


def synthetic_worker(root: Path) -> str:
    """The synthetic worker's module in the checkout at `root`: load.kit's, or where it was
    before load/ had a kit (tests.support)."""
    for module in ("load.kit.synthetic_worker", "tests.support.synthetic_upstream"):
        if (root / f"{module.replace('.', '/')}.py").exists():
            return module
    raise SystemExit(f"{root} has no synthetic worker")


def listens_on_unix_socket(root: Path) -> bool:
    """Whether the checkout at `root` reaches its worker on a Unix socket (its worker_address
    module, wherever that tree keeps it)."""
    return any((root / "appliance").rglob("worker_address.py"))


def imports_from(root: Path) -> Path:
    """Where the appliance started for `root` (this interpreter, PYTHONPATH and cwd `root`)
    imports its code from: `root` itself, or the bench measures the wrong tree."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(root)}
    code = "import appliance, supervisor; print(appliance.__file__); print(supervisor.__file__)"
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                          text=True, timeout=60, check=True)
    found = {Path(line).resolve().parents[1] for line in done.stdout.split()}
    if found != {root.resolve()}:
        raise SystemExit(f"the appliance for {root} would import from {sorted(found)}")
    return root


def start_appliance(port: int, upstream_port: int, tokens: int, token_delay_s: float,
                    api_key: str, workdir: Path, tls: tuple[Path, Path] | None = None,
                    name: str = "appliance", settings: dict[str, str] | None = None,
                    root: Path = ROOT, under: list[str] | None = None) -> Service:
    """`chat-appliance serve` supervising the synthetic upstream as its worker; with `tls`
    (certificate, key) its port speaks HTTPS. The appliance reaches the upstream on its Unix
    socket, as it reaches vLLM; the direct and LiteLLM runs use its port. With `root` another
    checkout's appliance and upstream, run from that checkout's code (a baseline from before
    workers had a Unix socket reaches it on its port). With `under` the appliance runs under
    that command (valgrind's, say); its worker does not."""
    socket_dir = workdir / f"worker-{name}"
    # This checkout's worker whatever the directory it starts in (a baseline's holds its own
    # load/ package): ROOT first on the path, then the module as `python -m` runs it.
    upstream = [sys.executable, "-c", "import runpy, sys; sys.path.insert(0, sys.argv.pop(1)); "
                f"runpy.run_module({synthetic_worker(ROOT)!r}, run_name='__main__', "
                "alter_sys=True)", str(ROOT), "--port", str(upstream_port),
                "--tokens", str(tokens), "--token-delay", str(token_delay_s)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHAT_APPLIANCE_")}
    if listens_on_unix_socket(root):
        upstream += ["--uds", str(socket_dir / "worker.sock")]
        env["CHAT_APPLIANCE_ENGINE__SOCKET_DIR"] = str(socket_dir)
    env |= {
        "CHAT_APPLIANCE_ENGINE__COMMAND": json.dumps(upstream),
        "CHAT_APPLIANCE_ENGINE__PORT": str(upstream_port),
        "CHAT_APPLIANCE_SERVER__PORT": str(port),
        "CHAT_APPLIANCE_SERVER__HOST": "127.0.0.1",
        "CHAT_APPLIANCE_SERVER__API_KEYS": json.dumps([api_key]),
        # 64 closed-loop clients sit exactly at the default admission cap; a client's next
        # request can race the slot its last one is releasing. The bench measures the proxy.
        "CHAT_APPLIANCE_POLICY__MAX_INFLIGHT": "256",
        "CHAT_APPLIANCE_LOGGING__FORMAT": "json",
        "PYTHONPATH": str(root),
    }
    if tls is not None:
        env |= {"CHAT_APPLIANCE_SERVER__TLS_CERTFILE": str(tls[0]),
                "CHAT_APPLIANCE_SERVER__TLS_KEYFILE": str(tls[1])}
    env |= settings or {}
    chat_appliance = Path(sys.executable).with_name("chat-appliance")
    if under is not None:  # the console script through the interpreter: a tool runs an ELF
        return _spawn(name, [*under, sys.executable, str(chat_appliance), "serve"], env, workdir,
                      root)
    return _spawn(name, [str(chat_appliance), "serve"], env, workdir, root)


def ensure_litellm(home: Path = LITELLM_HOME) -> Path | str:
    """LiteLLM's CLI from a throwaway venv (installed once); a reason string if impossible."""
    venv = home / "litellm-venv"
    cli = venv / "bin" / "litellm"
    if cli.exists():
        return cli
    home.mkdir(parents=True, exist_ok=True)
    log = home / "install.log"
    print(f"installing {LITELLM_SPEC} into {venv} (once; log: {log})", flush=True)
    with log.open("wb") as out:
        steps = [[sys.executable, "-m", "venv", str(venv)],
                 [str(venv / "bin" / "pip"), "install", "-q", LITELLM_SPEC]]
        for step in steps:
            try:
                code = subprocess.run(step, stdout=out, stderr=subprocess.STDOUT,
                                      timeout=900).returncode
            except subprocess.TimeoutExpired:
                return f"`{' '.join(step[-2:])}` timed out"
            if code != 0:
                return f"`{' '.join(step[-2:])}` failed ({code}); see {log}"
    return cli if cli.exists() else f"no litellm CLI after install; see {log}"


def start_litellm(cli: Path, port: int, upstream_port: int, api_key: str,
                  workdir: Path) -> Service:
    """LiteLLM's proxy, one worker, as an openai-compatible passthrough to the same upstream."""
    config = workdir / "litellm.yaml"
    config.write_text(
        "model_list:\n"
        "  - model_name: synthetic\n"
        "    litellm_params:\n"
        "      model: openai/synthetic\n"
        f"      api_base: http://127.0.0.1:{upstream_port}/v1\n"
        "      api_key: unused\n"
        "litellm_settings:\n"
        "  drop_params: true\n"
        "  turn_off_message_logging: true\n"
    )
    env = dict(os.environ) | {
        "LITELLM_MASTER_KEY": api_key,  # it refuses to start without one
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no fetch from the internet at start
        "LITELLM_LOG": "ERROR",
    }
    argv = [str(cli), "--config", str(config), "--host", "127.0.0.1", "--port", str(port),
            "--num_workers", "1"]
    return _spawn("litellm", argv, env, workdir)


def litellm_version(cli: Path) -> str:
    pip = cli.with_name("pip")
    try:
        out = subprocess.run([str(pip), "show", "litellm"], capture_output=True, text=True,
                             timeout=60).stdout
    except subprocess.TimeoutExpired:
        return "?"
    return next((line.split(":", 1)[1].strip() for line in out.splitlines()
                 if line.startswith("Version:")), "?")
