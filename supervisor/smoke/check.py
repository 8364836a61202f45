"""The GPU smoke check: `python -m supervisor.smoke.check`, JSON on stdout, a few minutes at most.

What the appliance relies on of a GPU box, checked on the box, with torch (a CUDA build),
nvidia-ml-py and psutil, and no vLLM and no network (none of the appliance's other
dependencies either: supervisor/smoke/bare_box.py):
  nvml         the project's monitor opened by index and by UUID, with typed readings
  xid_events   Xid events registered, and a drain that returns at once
  release      the release wait, timed against a real torch process tree that holds GPU
               memory and is then killed
  template     the worker template (supervisor/template/engine_side.py) after preloading torch
               and asking it for the device count: no CUDA context, NVML files only
  worker       a worker forked from that template: it forks a child that initialises CUDA and
               allocates memory (as EngineCore is forked), then initialises CUDA itself
Exit status: 0 every check passed, 1 one failed, 3 no GPU here (NVML finds none).
The torch side runs in `--python` (default: this interpreter; a bare name is looked up on PATH),
by path: supervisor/smoke/torch_side.py. Whatever fails, the JSON report is the output.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from supervisor.smoke import bare_box


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m supervisor.smoke.check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="0", help="NVML index of the GPU (default 0)")
    parser.add_argument("--python", default=sys.executable,
                        help="an interpreter with CUDA torch (default: this one)")
    parser.add_argument("--mib", type=int, default=256, help="GPU memory each process holds")
    parser.add_argument("--release-timeout-s", type=float, default=60.0)
    parser.add_argument("--release-slack-mib", type=int, default=256,
                        help="the release wait's slack where NVML lists no processes "
                             "(the appliance's gpu.release_slack_mib; default 256)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bare_box.log_to_stderr()  # stdout is the JSON alone
    from supervisor.smoke import checks as smoke_checks  # logs through what log_to_stderr set up

    status, report = asyncio.run(smoke_checks.run(args))
    print(json.dumps(report, indent=2, default=str))
    if status == smoke_checks.EXIT_NO_GPU:
        print("no GPU: NVML finds no NVIDIA GPU on this machine "
              f"(monitor status {report['nvml']['status']})", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
