"""The chat batch's route, through the gate and the relay."""

from __future__ import annotations

from litestar.handlers import HTTPRouteHandler

from appliance.apis.batch.api import BATCH_CHAT
from appliance.routes.generation import RouteDeps, generation


def routes(deps: RouteDeps) -> list[HTTPRouteHandler]:
    return [generation(BATCH_CHAT, deps)]
