"""The cost of the appliance itself: direct vs through the appliance vs through LiteLLM, in one run.

    python -m load.bench.gateway [--clients 64] [--rounds 3] [--round-s 8] [--tls]
                                 [--compare-resume] [--baseline CHECKOUT | --against REV]

One synthetic upstream (no model, tokens as fast as it can) is the appliance's supervised worker;
LiteLLM's proxy forwards to the same upstream. With --tls a second appliance, serving HTTPS (a
self-signed certificate, its clients on kept-alive connections), supervises a twin upstream:
the target `appliance-tls`, whose cost next to `appliance` is what TLS adds. With
--compare-resume another one, with `resume.enabled = false`, is the target
`appliance-noresume`: what keeping streams resumable costs (the upstream then writes token ids
as vLLM does). With --baseline CHECKOUT another checkout's appliance (say the tree before a
change) over this checkout's synthetic upstream is the target `baseline`: a change's cost, side by side
in one run; --against REV checks REV out in a temporary git worktree for that, and the report
ends with this tree against it. Closed-loop
clients drive each target in turn, streaming and non-streaming rounds alternating, the target
order rotated every round. Ratios are the result: everything here shares the same cores, the load
generator included.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import os
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from load.bench.client import Sample, Target, run_round
from load.bench.report import Report
from load.bench.stack import (
    ROOT,
    Service,
    cpu_seconds,
    ensure_litellm,
    imports_from,
    litellm_version,
    start_appliance,
    start_litellm,
    wait_http,
)
from load.kit import results
from load.kit.certs import self_signed

API_KEY = "sk-bench-0123456789abcdef"


@dataclass
class Stack:
    """The running services and the targets they expose; `missing` says why LiteLLM is absent."""

    appliance: Service
    upstream_pid: int
    targets: list[Target]
    cpu_pids: dict[str, list[tuple[int, bool]]]  # name -> [(pid, count its children)]
    services: list[Service] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=64, help="concurrent clients per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--round-s", type=float, default=8.0, help="seconds per target round")
    parser.add_argument("--warmup-s", type=float, default=2.0)
    parser.add_argument("--single-s", type=float, default=3.0,
                        help="seconds per target of the one-client (unloaded) round; 0: skip")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per answer")
    parser.add_argument("--token-delay", type=float, default=0.0,
                        help="upstream seconds per token (0: as fast as it can; 0.02: 50 tok/s)")
    parser.add_argument("--base-port", type=int, default=8340,
                        help="upstream, appliance and LiteLLM take this port and the next two; "
                             "the TLS appliance and its upstream the two after")
    parser.add_argument("--no-litellm", action="store_true")
    parser.add_argument("--compare-resume", action="store_true",
                        help="add an appliance with resume off (target appliance-noresume)")
    before = parser.add_mutually_exclusive_group()
    before.add_argument("--baseline", type=Path, metavar="CHECKOUT",
                        help="add another checkout's appliance (target baseline)")
    before.add_argument("--against", metavar="REV",
                        help="add the appliance of git revision REV, checked out in a "
                             "temporary worktree and run with this .venv (target baseline)")
    parser.add_argument("--tls", action="store_true",
                        help="also measure the appliance serving HTTPS (target appliance-tls)")
    results.add_option(parser)
    return parser.parse_args(argv)


def start_stack(args: argparse.Namespace, workdir: Path) -> Stack:
    upstream_port, appliance_port, litellm_port = (args.base_port + i for i in range(3))
    appliance = start_appliance(appliance_port, upstream_port, args.tokens, args.token_delay,
                                API_KEY, workdir)
    if not wait_http(appliance, f"http://127.0.0.1:{appliance_port}/health", 60):
        appliance.stop()
        raise SystemExit(f"the appliance never became ready:\n{appliance.tail()}")
    # The health JSON names the worker: that is the upstream, whose CPU is counted apart.
    upstream_pid = int(httpx.get(f"http://127.0.0.1:{appliance_port}/health", timeout=5,
                                 trust_env=False).json()["pid"])
    fast = [m for m in ("uvloop", "httptools") if importlib.util.find_spec(m) is not None]
    stack = Stack(appliance, upstream_pid,
                  [Target("direct", upstream_port), Target("appliance", appliance_port, API_KEY)],
                  {"upstream": [(upstream_pid, False)], "appliance": [(appliance.proc.pid, False)]},
                  [appliance])
    stack.notes.append(f"appliance: 1 process, API key set, max_inflight 256, server extras: "
                       f"{', '.join(fast) or 'none (asyncio loop, h11)'}")
    if args.tls:
        _add_tls_appliance(stack, args, workdir)
    if args.compare_resume:
        _add_noresume_appliance(stack, args, workdir)
    if args.baseline is not None:
        _add_baseline_appliance(stack, args, workdir)
    if args.no_litellm:
        stack.notes.append("litellm: unavailable (--no-litellm)")
    else:
        _add_litellm(stack, litellm_port, upstream_port, workdir)
    return stack


def _add_tls_appliance(stack: Stack, args: argparse.Namespace, workdir: Path) -> None:
    """The same appliance serving HTTPS, over a twin upstream (counted with the first: each
    idles while the other's target runs)."""
    port, upstream_port = args.base_port + 3, args.base_port + 4
    cert, key = self_signed(workdir, "bench")
    service = start_appliance(port, upstream_port, args.tokens, args.token_delay, API_KEY,
                              workdir, (cert, key), "appliance-tls")
    _join(stack, service, port, f"the same, serving HTTPS ({ssl.OPENSSL_VERSION}, EC P-256 "
          "certificate, TLS 1.3); its upstream a twin of the first",
          ssl.create_default_context(cafile=str(cert)))


def _add_noresume_appliance(stack: Stack, args: argparse.Namespace, workdir: Path) -> None:
    """The same appliance with resume off, over a twin upstream (as the TLS one)."""
    port, upstream_port = args.base_port + 5, args.base_port + 6
    service = start_appliance(port, upstream_port, args.tokens, args.token_delay, API_KEY,
                              workdir, None, "appliance-noresume",
                              {"CHAT_APPLIANCE_RESUME__ENABLED": "false"})
    _join(stack, service, port, "the same with resume.enabled = false; its upstream a twin of "
          "the first")


def _add_baseline_appliance(stack: Stack, args: argparse.Namespace, workdir: Path) -> None:
    """Another checkout's appliance, over this checkout's synthetic upstream (as every target)."""
    port, upstream_port = args.base_port + 7, args.base_port + 8
    root = imports_from(args.baseline.resolve())
    service = start_appliance(port, upstream_port, args.tokens, args.token_delay, API_KEY,
                              workdir, None, "baseline", root=root)
    what = f"revision {args.against}" if args.against else str(root)
    _join(stack, service, port, f"the appliance of {what} ({_commit(root)}), run from that "
          "tree's code, over this tree's synthetic upstream")


def _join(stack: Stack, service: Service, port: int, note: str,
          tls: ssl.SSLContext | None = None) -> None:
    """One more appliance as a target once it serves (named as its service), its CPU and its
    upstream's counted."""
    stack.services.append(service)
    url = f"{'https' if tls is not None else 'http'}://127.0.0.1:{port}/health"
    verify: ssl.SSLContext | bool = tls if tls is not None else True
    if not wait_http(service, url, 60, verify=verify):
        raise SystemExit(f"{service.name} never became ready:\n{service.tail()}")
    upstream_pid = int(httpx.get(url, timeout=5, trust_env=False, verify=verify).json()["pid"])
    stack.targets.append(Target(service.name, port, API_KEY, tls=tls))
    stack.cpu_pids[service.name] = [(service.proc.pid, False)]
    stack.cpu_pids["upstream"].append((upstream_pid, False))
    stack.notes.append(f"{service.name}: {note}")


@contextlib.contextmanager
def checked_out(rev: str, workdir: Path) -> Iterator[Path]:
    """`rev` of this checkout in a temporary git worktree (detached), removed at the end."""
    tree = workdir / "against"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--quiet", "--detach", str(tree),
                    rev], check=True, timeout=120)
    try:
        yield tree
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                       check=False, timeout=120)


def _commit(root: Path) -> str:
    try:
        return subprocess.run(["git", "-C", str(root), "log", "-1", "--format=%h %s"],
                              capture_output=True, text=True, check=True).stdout.strip()[:72]
    except (OSError, subprocess.CalledProcessError):
        return "not a git checkout"


def _add_litellm(stack: Stack, port: int, upstream_port: int, workdir: Path) -> None:
    cli = ensure_litellm()
    if isinstance(cli, str):
        stack.notes.append(f"litellm: unavailable ({cli})")
        return
    service = start_litellm(cli, port, upstream_port, API_KEY, workdir)
    stack.services.append(service)
    if not wait_http(service, f"http://127.0.0.1:{port}/health/liveliness", 120):
        stack.notes.append(f"litellm: unavailable (did not start; {service.log_path})")
        service.stop()
        return
    stack.targets.append(Target("litellm", port, API_KEY))
    stack.cpu_pids["litellm"] = [(service.proc.pid, True)]
    stack.notes.append(f"litellm {litellm_version(cli)}: proxy, 1 worker, master key set")


def _cpu(stack: Stack) -> dict[str, float]:
    now = {name: sum(cpu_seconds(pid, children) for pid, children in pids)
           for name, pids in stack.cpu_pids.items()}
    return now | {"generator": time.process_time()}


async def _measured(stack: Stack, target: Target, stream: bool, clients: int, seconds: float,
                    tokens: int, report: Report) -> Sample:
    before = _cpu(stack)
    sample = await run_round(target, stream, clients, seconds, tokens)
    after = _cpu(stack)
    report.add(target.name, stream, clients, sample,
               {name: after[name] - before[name] for name in after})
    return sample


async def drive(stack: Stack, args: argparse.Namespace, report: Report) -> None:
    """Warm-up, then rounds: for each round, streaming then non-streaming, targets rotated."""
    for target in stack.targets:
        for stream in (True, False):
            await run_round(target, stream, args.clients, args.warmup_s, args.tokens)
    for round_ in range(args.rounds):
        shift = round_ % len(stack.targets)
        order = stack.targets[shift:] + stack.targets[:shift]
        for stream in (True, False):
            for target in order:
                await _measured(stack, target, stream, args.clients, args.round_s, args.tokens,
                                report)
        print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    if args.single_s > 0:
        for stream in (True, False):
            for target in stack.targets:
                await _measured(stack, target, stream, 1, args.single_s, args.tokens, report)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with (tempfile.TemporaryDirectory(prefix="bench-gateway-") as tmp,
          contextlib.ExitStack() as trees, results.Printed() as printed):
        if args.against:
            args.baseline = trees.enter_context(checked_out(args.against, Path(tmp)))
        started = time.monotonic()
        stack = start_stack(args, Path(tmp))
        report = Report(args.clients, args.tokens, args.token_delay, args.rounds, args.round_s,
                        [t.name for t in stack.targets], stack.notes, os.cpu_count() or 0)
        try:
            asyncio.run(drive(stack, args, report))
        finally:
            for service in reversed(stack.services):
                service.stop()
        print(report.render(time.monotonic() - started))
    results.save(__spec__.name, argv, printed.text(), args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
