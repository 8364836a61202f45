"""Token ids a body names must be in the model's vocabulary.

vLLM checks `logit_bias` and `allowed_token_ids` against its vocabulary only when it builds the
request for its engine: a chat stream then ends with a 400 error event, a Responses stream is
cut after its first events. Checked here, it is a 400 before the engine sees anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from appliance.core.errors import BadRequest


def vocabulary_size(config: Mapping[str, Any]) -> int | None:
    """The vocabulary vLLM checks ids against (the model config's, or its text model's)."""
    for holder in (config, config.get("text_config")):
        if isinstance(holder, Mapping) and isinstance(holder.get("vocab_size"), int):
            return int(holder["vocab_size"])
    return None


def check_token_ids(body: Mapping[str, Any], vocabulary: int | None) -> None:
    """400 naming the field when a logit_bias key or an allowed token id is not a token id of
    the model; nothing to check where the vocabulary is not known."""
    if vocabulary is None:
        return
    bias = body.get("logit_bias")
    if isinstance(bias, Mapping):
        _check("logit_bias", [_as_id(key) for key in bias], vocabulary)
    allowed = body.get("allowed_token_ids")
    if isinstance(allowed, list):
        _check("allowed_token_ids", [_as_id(item) for item in allowed], vocabulary)


def _as_id(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    try:
        return int(value) if isinstance(value, str) else None
    except ValueError:
        return None


def _check(field: str, ids: list[int | None], vocabulary: int) -> None:
    wrong = [i for i in ids if i is None or not 0 <= i < vocabulary]
    if wrong:
        shown = ", ".join("?" if i is None else str(i) for i in wrong[:5])
        raise BadRequest(f"'{field}' names token ids outside the model's vocabulary of "
                         f"{vocabulary} ({shown}{', ...' if len(wrong) > 5 else ''})",
                         param=field, code="invalid_token_id", reason="invalid_token_id")
