"""`chat-appliance` command line: serve, check-config, status."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable, Sequence

import httpx

from appliance.settings import ConfigError, Settings, load_settings, masked_dump

EXIT_CONFIG = 2  # the unit's RestartPreventExitStatus: a bad config must not restart-loop


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="chat-appliance", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("serve", help="run the supervisor, the vLLM worker and the API")
    commands.add_parser("check-config", help="validate and print the effective settings")
    status = commands.add_parser("status", help="ask a running appliance's /health")
    status.add_argument("--url", help="base URL (default: http://127.0.0.1:<server.port>)")
    status.add_argument("--json", action="store_true", help="print the raw JSON")
    args = parser.parse_args(argv)
    handler = {"serve": _serve, "check-config": _check_config, "status": _status}[args.command]
    return handler(args)


def _settings_or_exit() -> Settings:
    try:
        return load_settings()
    except ConfigError as exc:
        print(f"chat-appliance: bad configuration: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG) from None


def _serve(_: argparse.Namespace) -> int:
    from supervisor import logs
    from supervisor.serve import serve

    settings = _settings_or_exit()
    logs.configure(settings.logging)
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        return runner.run(serve(settings))


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop where installed (it halves the event loop's share of each proxied request)."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def _check_config(_: argparse.Namespace) -> int:
    settings = _settings_or_exit()
    print(json.dumps(masked_dump(settings), indent=2))
    return 0


def _status(args: argparse.Namespace) -> int:
    settings = _settings_or_exit()
    url = args.url or f"http://127.0.0.1:{settings.server.port}"
    headers = {}
    if settings.server.api_keys:
        headers["Authorization"] = f"Bearer {settings.server.api_keys[0].get_secret_value()}"
    try:
        response = httpx.get(f"{url}/health", headers=headers, timeout=5, trust_env=False)
        detail = response.json()
    except (httpx.HTTPError, ValueError) as exc:
        print(f"chat-appliance is not answering at {url}: {exc}", file=sys.stderr)
        return 3
    if args.json:
        print(json.dumps(detail, indent=2))
    else:
        print(_describe_health(detail))
    return 0 if response.status_code == 200 else 1


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
