"""`chat-appliance doctor`: this box against everything the configured engine needs.

One module per family of checks (driver, kernel, toolchain, resources, access, state), each
check a function of a `Box` (the machine, faked in the tests) and the settings that returns one
`Finding`: ok, skip, warning or blocker, with the fix in one line. `serve` runs the fast ones
at start and refuses to start on a blocker a restart cannot cure.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from appliance.core.settings import ConfigError, Settings, config_path, load_settings
from supervisor.doctor.access import check_access, service_account
from supervisor.doctor.box import Box
from supervisor.doctor.driver import check_driver
from supervisor.doctor.kernel import check_device_nodes, check_uvm
from supervisor.doctor.report import Finding, Level, blocker, ok
from supervisor.doctor.resources import check_disk, check_models_gpu_memory, check_ports
from supervisor.doctor.state import check_state_dir
from supervisor.doctor.toolchain import check_compiler

log = structlog.get_logger("supervisor.doctor")

Check = Callable[[Box, Settings], Finding]

# What `serve` runs before anything else: no network, no NVML, no other user's view.
FAST_CHECKS: tuple[Check, ...] = (
    lambda box, s: check_driver(box, s.engine),
    lambda box, s: check_uvm(box, s.engine),
    lambda box, s: check_device_nodes(box, s.engine),
    lambda box, s: check_compiler(box, s.engine),
    # serve checks as itself; a path that does not exist (a wrong engine.model) is the worker's
    # boot failure to report on /health, as before: only what it may not read refuses here.
    lambda box, s: check_access(box, s, box.account(None), missing_ok=True),
    check_disk,
)


def fast_checks(settings: Settings, box: Box | None = None) -> list[Finding]:
    box = box or Box()
    return [check(box, settings) for check in FAST_CHECKS]


def preflight(settings: Settings, box: Box | None = None) -> Finding | None:
    """`serve`'s checks at start: what is not fine is logged with its fix; the first blocker a
    restart cannot cure is returned, for serve to refuse with."""
    findings = fast_checks(settings, box)
    for finding in findings:
        if finding.level in (Level.WARNING, Level.BLOCKER):
            log.warning("doctor.finding", check=finding.check, verdict=finding.level.value,
                        message=finding.message, fix=finding.fix)
    return next((finding for finding in findings if finding.refuses_start), None)


def all_checks(box: Box | None = None, user: str | None = None,
               before_install: bool = False) -> list[Finding]:
    """Everything, starting with the configuration (nothing else is checked without one).
    before_install: what install.sh has not built yet (venvs, model) is not reported missing."""
    box = box or Box()
    try:
        settings = load_settings()
    except ConfigError as exc:
        return [blocker("config", str(exc), "fix the file; chat-appliance check-config says the same")]
    source = config_path()
    findings = [ok("config", f"valid ({source or 'built-in defaults'})")]
    account = service_account(box, user)
    findings += [check_driver(box, settings.engine), check_uvm(box, settings.engine),
                 check_device_nodes(box, settings.engine), check_compiler(box, settings.engine),
                 *check_models_gpu_memory(box, settings), check_disk(box, settings),
                 check_access(box, settings, account, missing_ok=before_install),
                 check_state_dir(box, account), check_ports(box, settings)]
    return findings


__all__ = ["Box", "Finding", "all_checks", "fast_checks", "preflight"]
