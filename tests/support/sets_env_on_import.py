"""A stand-in for `import vllm`, which sets environment variables as it is imported."""

from __future__ import annotations

import os

os.environ["CHAT_APPLIANCE_SET_ON_IMPORT"] = "by-the-import"
