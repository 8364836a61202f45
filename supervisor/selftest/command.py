"""`chat-appliance selftest`: which appliance to test (the running service, with consent, or a
temporary one of its own), the run, the report, the exit status."""

from __future__ import annotations

import argparse
import ssl
import sys
import time
from typing import Any

import httpx

from appliance.core.catalog import Catalog
from appliance.core.sections import EngineSettings
from appliance.core.settings import Settings
from supervisor.doctor import all_checks
from supervisor.selftest.canary import CanaryStore
from supervisor.selftest.report import Check, Report
from supervisor.selftest.sequence import DISTURBS, run_checks
from supervisor.selftest.target import Target
from supervisor.selftest.temporary import Instance, temporary_instance

EXIT_REFUSED = 2


def selftest(args: argparse.Namespace, settings: Settings) -> int:
    url, verify = _service_url(settings)
    running = not args.temporary and _answers(url, verify)
    if running and not args.yes:
        print(f"chat-appliance is running at {url}. The self-test would disturb it:\n  - "
              + "\n  - ".join(DISTURBS)
              + "\nRun again with --yes to consent, or with --temporary to test an instance of "
              "its own on free ports instead (the box needs the memory for a second model).",
              file=sys.stderr)
        return EXIT_REFUSED
    if args.record_canary:
        model = _default_engine(settings).model
        forgotten = CanaryStore(settings.canary.resolved_file()).forget(model)
        print(f"canary: {forgotten} record(s) of {model} forgotten; the next worker start "
              "records them again", file=sys.stderr)
    findings = all_checks()  # before an instance of its own holds ports and memory
    started = time.monotonic()
    if running:
        report = Report("running", url, DISTURBS)
        run_checks(report, _target(url, settings, _first_key(settings), verify), settings,
                   findings)
    else:
        report = _temporary(settings, findings, verify)
    report.seconds = time.monotonic() - started
    print(report.to_json() if args.json else report.summary())
    if args.json:
        print(report.summary(), file=sys.stderr)
    return report.exit_status()


def _temporary(settings: Settings, findings: list[Any], verify: Any) -> Report:
    with temporary_instance() as instance:
        scheme = "https" if settings.server.tls else "http"
        url = instance.url.replace("http", scheme, 1)
        report = Report("temporary", url, ["nothing: an instance of its own, stopped at the end"])
        target = _target(url, settings, instance.api_key, verify)
        target.gone = lambda: (None if instance.proc.poll() is None
                               else f"the instance exited with status {instance.proc.returncode}")
        run_checks(report, target, settings, findings)
        if any(check.ok is False for check in report.checks):
            print(f"the temporary instance's log ends:\n{instance.log_tail()}", file=sys.stderr)
    report.checks.append(_nothing_left(instance))
    return report


def _nothing_left(instance: Instance) -> Check:
    left = instance.left_behind
    return Check("no process left behind", not left,
                 f"left: {', '.join(left)}" if left else
                 f"the instance and its {instance.sessions} process sessions "
                 f"are gone (exit {instance.proc.returncode})", {"left": len(left)})


def _target(url: str, settings: Settings, key: str | None, verify: Any) -> Target:
    return Target.connect(url, key, _default_engine(settings).model_name, settings.policy.max_n,
                          min(settings.supervisor.startup_timeout_s, 600.0), verify)


def _default_engine(settings: Settings) -> EngineSettings:
    """The default model's worker settings: the selftest proves the model that answers a
    request naming none (with a catalog, its default)."""
    return Catalog.from_settings(settings).default.engine


def _first_key(settings: Settings) -> str | None:
    if settings.server.api_keys:
        return settings.server.api_keys[0].get_secret_value()
    return None


def _service_url(settings: Settings) -> tuple[str, Any]:
    scheme = "https" if settings.server.tls else "http"
    verify: ssl.SSLContext | bool = True
    if settings.server.tls_certfile is not None:
        verify = ssl.create_default_context(cafile=settings.server.tls_certfile)
    return f"{scheme}://127.0.0.1:{settings.server.port}", verify


def _answers(url: str, verify: Any) -> bool:
    try:
        httpx.get(f"{url}/livez", timeout=3, trust_env=False, verify=verify)
    except httpx.HTTPError:
        return False
    return True
