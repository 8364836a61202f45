"""Cap how many sequences one request may ask the engine to decode at once."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from appliance.core.errors import BadRequest
from appliance.policy.body import check_count

# Each multiplies the sequences decoded per request: n choices, best_of candidates, and the
# beam width (vLLM takes it from n or best_of under use_beam_search; some clients send
# beam_width itself).
SEQUENCE_PARAMS = ("n", "best_of", "beam_width")


def check_n(body: Mapping[str, Any], max_n: int) -> None:
    """BadRequest naming the parameter when n, best_of or the beam width is above max_n."""
    beam = body.get("use_beam_search") is True
    for param in SEQUENCE_PARAMS:
        value = body.get(param)
        if value is None:
            continue
        check_count(value, param)
        if value > max_n:
            what = "beam width" if beam or param == "beam_width" else "value"
            raise BadRequest(
                f"'{param}' {what} {value} is above this appliance's limit of {max_n} "
                "(setting policy.max_n).",
                param=param,
                code="sequence_limit_exceeded",
                reason="n_cap",
            )
