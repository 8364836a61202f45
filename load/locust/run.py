"""One command for a load run: headless locust against a URL, reports, optional chaos, a verdict.

    python -m load.locust.run --url http://127.0.0.1:8000 --users 8 --duration 60 [--chaos]

Writes report.html, stats_*.csv, summary.json (and chaos.txt) under --out (default load/reports),
prints the summary and exits 0 only if every response was 2xx, 4xx or 503 and every request
got a terminal answer (and, with --chaos, the worker came back after every strike).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from load.faults.chaos import Chaos

ROOT = Path(__file__).resolve().parents[2]
LOCUSTFILE = Path(__file__).with_name("locustfile.py")
EXIT_PASS, EXIT_FAIL, EXIT_BROKEN = 0, 1, 2


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the appliance")
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--spawn-rate", type=float, default=None, help="users/s (default: all)")
    parser.add_argument("--duration", type=int, default=60, help="seconds of load")
    parser.add_argument("--out", type=Path, default=ROOT / "load" / "reports")
    parser.add_argument("--api-key", default=os.environ.get("LOAD_API_KEY", "unused"))
    parser.add_argument("--model", default="", help="model id (default: from /health)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="client read timeout, s (longer than a hang takes to detect)")
    parser.add_argument("--chaos", action="store_true", help="kill -9 / SIGSTOP the worker")
    parser.add_argument("--chaos-interval", type=float, default=30.0,
                        help="s of healthy load before each strike (and after each recovery)")
    parser.add_argument("--recovery-timeout", type=float, default=300.0,
                        help="s to wait after the run for the last strike to recover")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    summary_path = args.out / "summary.json"
    summary_path.unlink(missing_ok=True)
    headers = {"Authorization": f"Bearer {args.api_key}"}
    chaos = Chaos(args.url, args.chaos_interval, headers) if args.chaos else None
    restarts_before = _restarts(args.url, headers)
    try:
        code = _drive(args, summary_path, chaos)
        recovered = chaos is None or _settle(chaos, args.recovery_timeout)
    finally:
        if chaos is not None:
            chaos.release_hung()
            chaos.close()
    if not summary_path.exists():
        print(f"locust exited {code} without a summary; see {args.out / 'locust.log'}")
        return EXIT_BROKEN
    summary = json.loads(summary_path.read_text())
    chaos_lines = [s.line() for s in chaos.strikes] if chaos else None
    if chaos_lines is not None:
        (args.out / "chaos.txt").write_text("\n".join(chaos_lines) + "\n")
    restarts = _restarts(args.url, headers) - restarts_before
    # Without chaos nothing may restart the engine: a restart is a false alarm (a long
    # prefill called a hang) or a real crash, and either fails the run.
    summary["engine_restarts"] = restarts
    passed = bool(summary["passed"]) and recovered and (chaos is not None or restarts == 0)
    print(render(summary, args, chaos_lines, passed))
    return EXIT_PASS if passed else EXIT_FAIL


def locust_command(args: argparse.Namespace) -> list[str]:
    users = max(1, args.users)
    return [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
        "--host", args.url.rstrip("/"), "-u", str(users),
        "-r", str(args.spawn_rate or users), "-t", f"{args.duration}s",
        # Users finish the request in hand; a client times out first, so each is accounted for.
        "--stop-timeout", str(int(args.timeout) + 15),
        "--html", str(args.out / "report.html"), "--csv", str(args.out / "stats"),
        "--only-summary", "--loglevel", "WARNING",
    ]


def _drive(args: argparse.Namespace, summary_path: Path, chaos: Chaos | None) -> int:
    """Run locust to its end (bounded), striking the worker meanwhile when chaos is on."""
    env = os.environ | {
        "LOAD_SUMMARY": str(summary_path), "LOAD_API_KEY": args.api_key,
        "LOAD_MODEL": args.model or _model(args.url, args.api_key),
        "LOAD_MAX_TOKENS": str(args.max_tokens), "LOAD_TIMEOUT_S": str(args.timeout),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    limit_s = args.duration + args.timeout + 60
    with (args.out / "locust.log").open("w") as log:
        proc = subprocess.Popen(locust_command(args), cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT)
        start = time.monotonic()
        if chaos is not None:
            chaos.begin()
        try:
            while proc.poll() is None and time.monotonic() - start < limit_s:
                if chaos is not None:
                    chaos.tick(until_s=args.duration - 5)
                time.sleep(0.5)
        finally:
            if proc.poll() is None:
                proc.kill()
            code = proc.wait(30)
    return code


def _settle(chaos: Chaos, timeout_s: float) -> bool:
    """After the load: give the last strike time to recover (bounded)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if chaos.settle() or not chaos.strikes:
            break
        time.sleep(1.0)
    return chaos.settle()


def _restarts(url: str, headers: dict[str, str]) -> float:
    """appliance_engine_restarts_total, all causes, from /metrics (0 if unreadable)."""
    try:
        text = httpx.get(f"{url}/metrics", headers=headers, timeout=10, trust_env=False).text
    except httpx.HTTPError:
        return 0.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("appliance_engine_restarts_total{"))


def _model(url: str, api_key: str) -> str:
    """The served model id, from /v1/models, else /health (it may be restarting); '' if neither."""
    headers = {"Authorization": f"Bearer {api_key}"}
    for path in ("/v1/models", "/health"):
        try:
            response = httpx.get(f"{url}{path}", headers=headers, timeout=10, trust_env=False)
            if response.status_code == 200:
                data = response.json()
                return str(data["data"][0]["id"] if path == "/v1/models" else data["model"])
        except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError):
            continue
    return ""


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f} ms"


def _rate(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f} tok/s"


def render(summary: dict[str, Any], args: argparse.Namespace, chaos: list[str] | None,
           passed: bool) -> str:
    """The human summary: statuses, timings, chaos, where the reports are, the verdict."""
    statuses = ", ".join(f"{k}: {v}" for k, v in summary["by_status"].items()) or "none"
    lines = [f"== load run: {args.users} users, {args.duration} s, {args.url}, "
             f"chaos {'on' if chaos is not None else 'off'} ==",
             f"requests: {summary['requests']}  by status: {statuses}"]
    for scenario, counts in summary["by_scenario"].items():
        lines.append(f"  {scenario:<28} " + ", ".join(f"{k}: {v}" for k, v in counts.items()))
    ttft, tps = summary["ttft_ms"], summary["tokens_per_s_per_stream"]
    lines += [f"TTFT: p50 {_ms(ttft['p50'])}, p95 {_ms(ttft['p95'])} (n={ttft['count']})",
              f"tokens/s per stream: p50 {_rate(tps['p50'])}, p5 {_rate(tps['p5'])}; "
              f"all streams together: {_rate(summary['streamed_tokens_per_s_aggregate'])}",
              f"SSE error events (engine lost mid-stream): {summary['sse_error_events']}",
              f"engine restarts during the run: {summary['engine_restarts']:g}"
              + ("" if chaos is not None else " (without chaos: must be 0)")]
    if chaos is not None:
        chaos = chaos or ["no strike made (run shorter than --chaos-interval, or never ready)"]
        lines += ["chaos:"] + [f"  {line}" for line in chaos]
    failures = summary["failures"]
    lines += ["failures: none" if not failures else "failures:"]
    lines += [f"  {count} x {reason}" for reason, count in failures.items()]
    lines += [f"reports: {args.out}/report.html, {args.out}/stats_*.csv, {args.out}/summary.json",
              f"verdict: {'PASS' if passed else 'FAIL'}"]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
