"""A stand-in worker run as `python -m tests.support.tree_worker`: it reports how it was started
(argv, cwd, session, stdin, one env var) as a JSON line on stdout, writes a line to stderr,
optionally starts a child the way vLLM starts EngineCore, then exits or sleeps."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--exit", type=int, default=None, help="exit at once with this status")
    parser.add_argument("--child", action="store_true", help="start a sleeping child")
    parser.add_argument("--ignore-term", action="store_true", help="ignore SIGTERM, as a busy vLLM")
    parser.add_argument("--env", default="TREE_WORKER_MARK", help="the env var to report")
    args = parser.parse_args()
    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.child:
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    stdin, devnull = os.fstat(0), os.stat(os.devnull)
    print(json.dumps({
        "argv": sys.argv, "cwd": os.getcwd(), "pid": os.getpid(),
        "leads_session": os.getsid(0) == os.getpid(), "leads_group": os.getpgid(0) == os.getpid(),
        "stdin_is_devnull": (stdin.st_rdev, stdin.st_ino) == (devnull.st_rdev, devnull.st_ino),
        "env": os.environ.get(args.env), "main": __name__,
    }), flush=True)
    print("tree_worker stderr line", file=sys.stderr, flush=True)
    if args.exit is not None:
        return args.exit
    time.sleep(600)
    return 0


if __name__ == "__main__":
    sys.exit(main())
