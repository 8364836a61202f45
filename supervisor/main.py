"""`chat-appliance` command line: serve, check-config, status, reload, drain, doctor, crashes,
selftest."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import ssl
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

import httpx

from appliance.core.settings import ConfigError, Settings, load_settings, masked_dump
from supervisor.operator.control import ask

EXIT_CONFIG = 2  # the unit's RestartPreventExitStatus: a bad config (or box) must not restart-loop
EXIT_NOT_ANSWERING = 3
EXIT_INTERRUPTED = 130  # as a shell reports a command stopped by a signal
WATCH_INTERVAL_S = 2.0
_CLEAR_SCREEN = "\x1b[H\x1b[2J"

# One /health answer: (HTTP status, JSON body); raises HealthUnavailable when none came.
HealthSource = Callable[[], tuple[int, dict[str, Any]]]


class HealthUnavailable(Exception):
    """The appliance did not answer /health (not running, wrong URL, not JSON)."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="chat-appliance", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("serve", help="run the supervisor, the vLLM worker and the API")
    commands.add_parser("check-config", help="validate and print the effective settings")
    status = commands.add_parser("status", help="ask a running appliance's /health")
    status.add_argument("--url", help="base URL (default: http://127.0.0.1:<server.port>)")
    status.add_argument("--json", action="store_true", help="print the raw JSON")
    status.add_argument("--watch", action="store_true",
                        help="refresh until interrupted (Ctrl-C); keeps going while it restarts")
    status.add_argument("--interval", type=_positive_seconds, default=WATCH_INTERVAL_S,
                        metavar="S", help=f"seconds between refreshes (default {WATCH_INTERVAL_S})")
    reload = commands.add_parser("reload", help="reload the clients, keys and TLS certificate "
                                 "of a running appliance from its configuration (rotation)")
    reload.add_argument("--socket", type=Path,
                        help="its control socket (default: server.control_socket)")
    drain = commands.add_parser("drain", help="make a running appliance not ready at once, let "
                                "what it holds finish (supervisor.drain_timeout_s), then stop "
                                "(exit 0); new requests meanwhile get 503 + Retry-After")
    drain.add_argument("--socket", type=Path,
                       help="its control socket (default: server.control_socket)")
    drain.add_argument("--wait", action="store_true",
                       help="return only once it has stopped (its control socket is gone)")
    doctor = commands.add_parser("doctor", help="check this machine against what the "
                                 "configured engine needs; exit status 1 on a blocker")
    doctor.add_argument("--json", action="store_true", help="print the findings as JSON")
    doctor.add_argument("--user", help="whose access to check (default: the service user "
                        "when run as root and it exists, else the caller)")
    doctor.add_argument("--before-install", action="store_true",
                        help="for install.sh: what it has not built yet is not reported missing")
    crashes = commands.add_parser("crashes", help="list the engine's crash bundles, or show one")
    crashes.add_argument("show", nargs="?", metavar="NAME",
                         help="show this bundle (\"last\": the newest)")
    crashes.add_argument("--json", action="store_true", help="print the bundle's raw JSON")
    selftest = commands.add_parser("selftest", help="prove this box in minutes: every API, the "
                                   "gate, disconnect, kill -9 and freeze back to ready, the "
                                   "correctness canary; exit status 1 on a failure")
    _selftest_arguments(selftest)
    args = parser.parse_args(argv)
    handler = {"serve": _serve, "check-config": _check_config, "status": _status,
               "reload": _reload, "drain": _drain, "doctor": _doctor,
               "crashes": _crashes, "selftest": _selftest}[args.command]
    return handler(args)


def _settings_or_exit() -> Settings:
    try:
        return load_settings()
    except ConfigError as exc:
        print(f"chat-appliance: bad configuration: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG) from None


def _serve(_: argparse.Namespace) -> int:
    from appliance.core.upstream import loop_factory
    from supervisor.doctor import preflight
    from supervisor.doctor.report import one_line
    from supervisor.observe import logs
    from supervisor.serve import serve

    settings = _settings_or_exit()
    logs.configure(settings.logging)
    # A box that cannot run the engine (an old driver, no compiler) would only crash-loop:
    # refuse with the reason and the exit status the unit does not restart on.
    refusal = preflight(settings)
    if refusal is not None:
        print(f"chat-appliance: cannot start: {one_line(refusal)}", file=sys.stderr)
        return EXIT_CONFIG
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(serve(settings))


def _doctor(args: argparse.Namespace) -> int:
    from supervisor.doctor import all_checks
    from supervisor.doctor.report import Level, render_json, render_text

    findings = all_checks(user=args.user, before_install=args.before_install)
    print(render_json(findings) if args.json else render_text(findings))
    return 1 if any(finding.level is Level.BLOCKER for finding in findings) else 0


def _check_config(_: argparse.Namespace) -> int:
    settings = _settings_or_exit()
    print(json.dumps(masked_dump(settings), indent=2))
    return 0


def _crashes(args: argparse.Namespace) -> int:
    from supervisor.forensics.command import crashes

    return crashes(_settings_or_exit().crashes, args.show, args.json, sys.stdout)


def _selftest_arguments(parser: argparse.ArgumentParser) -> None:
    from supervisor.selftest import add_arguments

    add_arguments(parser)


def _selftest(args: argparse.Namespace) -> int:
    from supervisor.observe import logs
    from supervisor.selftest.command import selftest

    settings = _settings_or_exit()
    logs.configure(settings.logging)
    # SIGTERM (a timeout, a CI job cancelled) unwinds as Ctrl-C does: an instance of its own is
    # stopped on the way out, and a frozen EngineCore resumed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(EXIT_INTERRUPTED))
    return selftest(args, settings)


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, not {text}")
    return value


def _status(args: argparse.Namespace) -> int:
    settings = _settings_or_exit()
    scheme = "https" if settings.server.tls else "http"
    url = args.url or f"{scheme}://127.0.0.1:{settings.server.port}"
    # Its own certificate names 127.0.0.1 where install.sh made it; another one needs --url.
    verify: ssl.SSLContext | bool = True
    if settings.server.tls_certfile is not None:
        verify = ssl.create_default_context(cafile=settings.server.tls_certfile)
    headers = {}
    if settings.server.api_keys:
        headers["Authorization"] = f"Bearer {settings.server.api_keys[0].get_secret_value()}"

    def fetch() -> tuple[int, dict[str, Any]]:
        try:
            response = httpx.get(f"{url}/health", headers=headers, timeout=5, trust_env=False,
                                 verify=verify)
            return response.status_code, dict(response.json())
        except (httpx.HTTPError, ValueError) as exc:
            raise HealthUnavailable(f"chat-appliance is not answering at {url}: {exc}") from exc

    render = (lambda detail: json.dumps(detail, indent=2)) if args.json else _describe_health
    if args.watch:
        return watch_status(fetch, render, args.interval, sys.stdout)
    try:
        code, detail = fetch()
    except HealthUnavailable as exc:
        print(exc, file=sys.stderr)
        return EXIT_NOT_ANSWERING
    print(render(detail))
    return 0 if code == 200 else 1


def watch_status(
    fetch: HealthSource,
    render: Callable[[dict[str, Any]], str],
    interval_s: float,
    out: TextIO,
    *,
    sleep: Callable[[float], None] = time.sleep,
    now: Callable[[], str] = lambda: time.strftime("%H:%M:%S"),
) -> int:
    """Print the health every interval_s until Ctrl-C: the screen redrawn on a terminal, one
    block after another into a pipe. An appliance that stops answering is shown, not fatal."""
    clear = _CLEAR_SCREEN if out.isatty() else ""
    try:
        while True:
            try:
                body = render(fetch()[1])
            except HealthUnavailable as exc:
                body = str(exc)
            out.write(f"{clear}{now()}  every {interval_s:g} s, Ctrl-C to stop\n{body}\n\n")
            out.flush()
            sleep(interval_s)
    except KeyboardInterrupt:
        return 0


def _ask_control(path: Path, verb: str, otherwise: str) -> dict[str, Any] | None:
    """The running appliance's answer to `verb` on its control socket; None, said why, where
    it is not answering (`otherwise`: the signal that does the same)."""
    try:
        return ask(path, verb)
    except (OSError, ValueError) as exc:
        print(f"chat-appliance is not answering on {path}: {exc} (run this as the service "
              f"user or root; or {otherwise})", file=sys.stderr)
        return None


def _reload(args: argparse.Namespace) -> int:
    """Ask the running appliance, on its control socket, to reload its clients and certificate;
    it reads its own configuration, and keeps what is in force if that is wrong (exit 2)."""
    settings = _settings_or_exit()  # a file with an error is refused here already (exit 2)
    answer = _ask_control(_control_path(args, settings), "reload", "kill -HUP the supervisor")
    if answer is None:
        return EXIT_NOT_ANSWERING
    if not answer.get("ok"):
        print(f"chat-appliance: {answer.get('error')}", file=sys.stderr)
        return EXIT_CONFIG if answer.get("code") == "bad_configuration" else 1
    names = ", ".join(answer["clients"]) or "none"
    tls = f"; certificate {answer['tls_fingerprint']}" if "tls_fingerprint" in answer else ""
    print(f"reloaded: clients {names}; {answer['keys']} keys (generation {answer['generation']})"
          f"{tls}")
    return 0


def _drain(args: argparse.Namespace) -> int:
    """Ask the running appliance, on its control socket, to drain and stop, as SIGTERM does."""
    settings = _settings_or_exit()
    path = _control_path(args, settings)
    answer = _ask_control(path, "drain", "send the supervisor SIGTERM")
    if answer is None:
        return EXIT_NOT_ANSWERING
    if not answer.get("ok"):
        print(f"chat-appliance: {answer.get('error')}", file=sys.stderr)
        return 1
    print(f"draining: {answer['in_flight']} in flight, stopping within "
          f"{answer['drain_timeout_s']:g} s")
    if not args.wait:
        return 0
    # The supervisor removes its socket as the last step of its stop.
    sup = settings.supervisor
    deadline = time.monotonic() + sup.drain_timeout_s + sup.stop_grace_s + 60
    while _present(path):
        if time.monotonic() > deadline:
            print(f"chat-appliance: still running after the drain's bound ({path})",
                  file=sys.stderr)
            return 1
        time.sleep(0.2)
    print("stopped")
    return 0


def _control_path(args: argparse.Namespace, settings: Settings) -> Path:
    candidates = [args.socket] if args.socket else settings.server.control_socket_candidates()
    return next((found for found in candidates if _present(found)), candidates[0])


def _present(path: Path) -> bool:
    """There, or behind a directory this user may not enter (ask then says why)."""
    try:
        return path.exists()
    except PermissionError:
        return True


def _describe_health(detail: dict[str, object]) -> str:
    last = detail.get("last_exit") or {}
    lines = [
        f"engine:   {detail.get('state')} (pid {detail.get('pid')}, model {detail.get('model')})",
        f"uptime:   {detail.get('uptime_s')} s serving, supervisor {detail.get('supervisor_uptime_s')} s",
        f"restarts: {detail.get('restarts')}",
    ]
    if isinstance(last, dict) and last:
        lines.append(f"last exit: {last.get('phase')} {last.get('reason')}: {last.get('detail')}")
    gpu = detail.get("gpu")
    if isinstance(gpu, dict):
        lines.append(f"gpu:      {gpu.get('status', gpu)}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
