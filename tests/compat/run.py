"""Run vLLM's own OpenAI-server tests against the worker and through the appliance, and compare.

    .venv/bin/python -m tests.compat.run --serve
    .venv/bin/python -m tests.compat.run --direct http://127.0.0.1:8100 --appliance http://127.0.0.1:8000

`--serve` starts `chat-appliance serve` (real supervisor, real worker, with the worker flags the
selection needs) and stops it afterwards; otherwise both endpoints must already serve the same
model. The same selection runs twice, one run after the other: counts, the tests whose outcome
differs, and a verdict (exit 0 only when every difference is a deliberate one). vLLM's tests
come from its sdist on PyPI, cached under ~/.cache/chat-appliance/compat (a cold cache
downloads ~45 MB once).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from appliance.core.sections import default_engine_python, default_model
from tests.compat import environment, sdist
from tests.compat.compare import RunResult, Verdict, differences
from tests.compat.selection import EXCLUDED, FILES, VLLM_VERSION, WORKER_FLAGS

CACHE_ENV = "CHAT_APPLIANCE_COMPAT_CACHE"
DEFAULT_CACHE = Path.home() / ".cache" / "chat-appliance" / "compat"
PLUGIN_DIR = Path(__file__).resolve().parent
PLUGIN = "vllm_endpoint_plugin"
TEST_TIMEOUT_S = 300  # one test; vLLM's slowest here generate ~1000 tokens
RUN_TIMEOUT_S = 3600  # one whole run of the selection
# `--serve` only: the worker is busy with traffic the supervisor cannot see (the direct run),
# so its idle canary must not take a queued decode for a hang.
# vLLM's own tests run against the worker directly, by URL: the worker's TCP fallback.
SERVE_SETTINGS = {"supervisor__canary_timeout_s": "600", "engine__max_model_len": "8192",
                  "engine__listen": "tcp"}


@dataclass(frozen=True)
class Suite:
    """What one run needs besides its endpoint."""

    python: Path
    tree: Path
    model_dir: Path
    workdir: Path
    api_key: str
    test_timeout_s: float
    pytest_args: tuple[str, ...] = ()


def prepare(cache: Path, engine_python: Path) -> tuple[Path, Path]:
    """(test tree, interpreter): downloaded and built on a cold cache, reused after."""
    tree = sdist.ensure_tree(cache, VLLM_VERSION)
    return tree, environment.ensure_env(cache, engine_python, tree)


def plugin_env(tree: Path, endpoint: str, model_dir: Path, api_key: str, exclude: Path,
               report: Path) -> dict[str, str]:
    """The environment of a pytest in vLLM's tree with the endpoint plugin configured."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # vLLM's tree first: its `tests` package is the one its tests import.
    return env | {"PYTHONPATH": os.pathsep.join([str(tree), str(PLUGIN_DIR)]),
                  "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                  "COMPAT_ENDPOINT": endpoint, "COMPAT_MODEL_DIR": str(model_dir),
                  "COMPAT_API_KEY": api_key, "COMPAT_EXCLUDE_FILE": str(exclude),
                  "COMPAT_REPORT_FILE": str(report)}


def pytest_argv(python: Path, tree: Path, paths: Sequence[str], *extra: str) -> list[str]:
    """pytest with the plugin, rooted in vLLM's tree (its pyproject.toml declares the markers)."""
    return [str(python), "-m", "pytest", "-p", PLUGIN, "-p", "no:cacheprovider",
            "--rootdir", str(tree), "-c", str(tree / "pyproject.toml"),
            *(str(tree / path) for path in paths), *extra]


def run_once(suite: Suite, label: str, endpoint: str) -> RunResult:
    """The selection against one endpoint, in a pytest of its own inside vLLM's tree."""
    scratch = suite.workdir / label  # the working directory: the plugin links the model here
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    exclude, report, log = scratch / "exclude.json", scratch / "report.json", scratch / "pytest.log"
    exclude.write_text(json.dumps(EXCLUDED, indent=1))
    env = plugin_env(suite.tree, endpoint, suite.model_dir, suite.api_key, exclude, report)
    argv = pytest_argv(suite.python, suite.tree, FILES, "-q", "-rfE",
                       f"--timeout={suite.test_timeout_s:.0f}", *suite.pytest_args)
    print(f"compat: {label} run against {endpoint} (log: {log})", flush=True)
    started = time.monotonic()
    with log.open("wb") as out:
        try:
            code = subprocess.run(argv, cwd=scratch, env=env, stdout=out, stderr=subprocess.STDOUT,
                                  timeout=RUN_TIMEOUT_S, check=False).returncode
        except subprocess.TimeoutExpired:
            code = -1
    return RunResult.from_report(label, endpoint, time.monotonic() - started, report, code)


def worker_identity(appliance: str, api_key: str) -> tuple[object, object] | None:
    """(worker pid, restarts) from the appliance's /health; None where it does not say."""
    with contextlib.suppress(httpx.HTTPError, ValueError):
        health = httpx.get(f"{appliance}/health", timeout=10,
                           headers={"Authorization": f"Bearer {api_key}"}).json()
        return health.get("pid"), health.get("restarts")
    return None


def compare_endpoints(suite: Suite, direct: str, appliance: str) -> Verdict:
    """Both runs, then the verdict; a worker restarted in between makes the runs incomparable."""
    before = worker_identity(appliance, suite.api_key)
    direct_run = run_once(suite, "direct", direct)
    appliance_run = run_once(suite, "appliance", appliance)
    after = worker_identity(appliance, suite.api_key)
    if before != after:
        print(f"compat: WARNING the worker changed during the runs (pid, restarts: {before} -> "
              f"{after}); failures may be the restart's, not the route's", flush=True)
    return Verdict(direct_run, appliance_run, differences(direct_run, appliance_run))


@contextlib.contextmanager
def served(workdir: Path) -> Iterator[tuple[str, str]]:
    """A real `chat-appliance serve` with the selection's worker flags: (worker URL, appliance URL)."""
    from load.kit.appliance import running_appliance

    settings = SERVE_SETTINGS | {"engine__extra_args": json.dumps(list(WORKER_FLAGS))}
    with running_appliance(workdir, **settings) as appliance:
        appliance.wait_ready()
        yield f"http://127.0.0.1:{appliance.engine_port}", appliance.url


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.compat.run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--serve", action="store_true", help="start chat-appliance serve for the runs")
    target.add_argument("--direct", metavar="URL", help="the vLLM worker itself")
    parser.add_argument("--appliance", metavar="URL", help="the appliance in front of that worker")
    parser.add_argument("--api-key", default="", help="a key of the appliance's server.api_keys")
    parser.add_argument("--cache", type=Path, default=Path(os.environ.get(CACHE_ENV, DEFAULT_CACHE)))
    parser.add_argument("--engine-python", type=Path, default=default_engine_python())
    parser.add_argument("--model-dir", type=Path, default=Path(default_model()),
                        help="the served model's directory (vLLM's tests load its tokenizer)")
    parser.add_argument("--test-timeout", type=float, default=TEST_TIMEOUT_S, metavar="S")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the verdict as JSON")
    parser.add_argument("pytest_args", nargs="*", help="after --: passed to both pytest runs (-k ...)")
    args = parser.parse_args(argv)
    if args.direct and not args.appliance:
        parser.error("--direct needs --appliance")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    tree, python = prepare(args.cache, args.engine_python)
    workdir = args.cache / "last-run"  # logs and reports of the latest run, kept for reading
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    suite = Suite(python, tree, args.model_dir, workdir, args.api_key, args.test_timeout,
                  tuple(args.pytest_args))
    with contextlib.ExitStack() as stack:
        direct, appliance = (stack.enter_context(served(workdir)) if args.serve
                             else (args.direct, args.appliance))
        verdict = compare_endpoints(suite, direct.rstrip("/"), appliance.rstrip("/"))
    print(verdict.render())
    print(f"compat: {time.monotonic() - started:.0f} s in all; logs and reports in {workdir}")
    if args.json:
        args.json.write_text(json.dumps(verdict.as_json(), indent=1))
    return 0 if verdict.ok else 1


if __name__ == "__main__":
    sys.exit(main())
