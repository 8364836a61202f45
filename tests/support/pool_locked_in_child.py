"""A preload standing in for one that started a thread pool a forked child cannot use, as
torch's OpenMP pool is once it has run: a thread of the pool holds its lock, and the `torch` it
provides needs that lock, which a forked child never gets."""

from __future__ import annotations

import sys
import threading
import types

_pool_lock = threading.Lock()
_holding = threading.Event()


def _pool_thread() -> None:
    with _pool_lock:
        _holding.set()
        threading.Event().wait()


def _ones(*shape: int) -> None:
    with _pool_lock:
        return None


threading.Thread(target=_pool_thread, name="pool", daemon=True).start()
_holding.wait()
sys.modules["torch"] = types.SimpleNamespace(
    ones=_ones, cuda=types.SimpleNamespace(is_initialized=lambda: False))
