"""A preload standing in for a torch that has initialised CUDA (the template must refuse it)."""

from __future__ import annotations

import sys
import types

sys.modules["torch"] = types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda: True))
