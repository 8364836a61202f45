"""The worker's tokenizer and version routes: tokenize and detokenize through the gate (they
render templates and fetch media as generation does, so they take an admission slot), the
tokenizer's description and vLLM's version passed through as they are."""

from __future__ import annotations

from litestar.handlers import HTTPRouteHandler

from appliance.apis.tokenizer.api import DETOKENIZE, TOKENIZE, TOKENIZER_INFO, VERSION
from appliance.core.errors import ApiError, NotFound
from appliance.routes.generation import RouteDeps, generation, passed_through


def routes(deps: RouteDeps) -> list[HTTPRouteHandler]:
    return [
        generation(TOKENIZE, deps),
        generation(DETOKENIZE, deps),
        passed_through(TOKENIZER_INFO, deps, _tokenizer_info_disabled),
        passed_through(VERSION, deps),
    ]


def _tokenizer_info_disabled(error: ApiError) -> ApiError:
    if error.status != 404:
        return error
    return NotFound("GET /tokenizer_info is not enabled on this engine: vLLM serves it with "
                    "--enable-tokenizer-info-endpoint (setting engine.extra_args).",
                    code="not_enabled", reason="not_enabled")
