"""CPU time of another process to the nanosecond: its ended threads counted, each live one read."""

from __future__ import annotations

import subprocess
import sys

from load.kit.procstat import cpu_ns, thread_cpu_ns

# A child whose thread burns CPU and ends; it prints what that thread used, then waits.
# join() returns before the kernel has reaped the thread: its task is waited out before the print.
CHILD = """
import os, sys, threading, time
used = []
def burn():
    while time.thread_time_ns() < 50_000_000:
        pass
    used.append(time.thread_time_ns())
thread = threading.Thread(target=burn)
thread.start()
thread.join()
while len(os.listdir("/proc/self/task")) > 1:
    time.sleep(0.001)
print(used[0], flush=True)
sys.stdin.read()
"""


def test_a_process_cpu_counts_its_ended_threads_and_its_threads_are_read_each() -> None:
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdin is not None
        burned = int(child.stdout.readline())
        threads = thread_cpu_ns(child.pid)
        assert list(threads) == [child.pid]  # the burner has ended: only the main thread is left
        assert cpu_ns(child.pid) >= burned + threads[child.pid]
    finally:
        child.communicate("")
    assert cpu_ns(child.pid) == 0 and thread_cpu_ns(child.pid) == {}  # reaped: gone
