"""The models the API serves, each with its engine and relay, and which one answers a request.

With a catalog (`[models.<name>]` tables) a request goes to the model its body's `model` names
(its name or an alias; none: the default), and a name the catalog lacks is a 404 in the route's
shape before any work is done. Without one, the single model of `[engine]` answers every
request and the worker judges the name, as it always did. A model whose worker is not ready is
a 503 with Retry-After for its own requests only.

With residency (supervisor.engine.residency) a model need not be loaded: a request for one
that is not waits for its load instead of a 503, holding a lease on its model until it ends.

Readiness of the box: every pinned model (the default, unless it says otherwise) is ready.
/health, /readyz and the routers' guard read it here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
from litestar.types import ASGIApp, Receive, Scope, Send

from appliance.core.catalog import CatalogEntry
from appliance.core.engine import EngineState, EngineView, Residency
from appliance.core.errors import EngineUnavailable, NotFound
from appliance.gate.gate import Vetted
from appliance.proxy.request import RelayDeps


class _Named(msgspec.Struct):
    """The one field routing reads; every other field is skipped, not built."""

    model: object = None


_named = msgspec.json.Decoder(_Named)


@dataclass(frozen=True)
class ServedModel:
    entry: CatalogEntry
    relay: RelayDeps

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def engine(self) -> EngineView:
        return self.relay.engine

    @property
    def ready(self) -> bool:
        return self.engine.state is EngineState.READY


class ServedModels:
    """The catalog's models in order, the default first. `routed`: a catalog was configured,
    so the appliance itself routes by `model` (and refuses a name it does not know)."""

    def __init__(self, models: list[ServedModel], *, routed: bool,
                 residency: Residency | None = None) -> None:
        self._models = models
        self.routed = routed
        self.residency = residency
        self._by_name = {served: model for model in models for served in model.entry.served_names}

    @property
    def default(self) -> ServedModel:
        return self._models[0]

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(self._models)

    def __len__(self) -> int:
        return len(self._models)

    def find(self, name: str) -> ServedModel | None:
        return self._by_name.get(name)

    def serving(self, engine: EngineView) -> ServedModel:
        """The model whose worker `engine` is (the default if none is)."""
        return next((model for model in self._models if model.engine is engine), self.default)

    def pick(self, raw: bytes) -> ServedModel:
        """The model `raw`'s `model` names: 404 for a name the catalog lacks; without
        residency, 503 with Retry-After while that model's worker is not ready. A body that is
        not a JSON object, or a `model` that is not a string, goes to the default, whose gate
        refuses it with the route's own 400."""
        if not self.routed:
            return self.default
        try:
            wanted = _named.decode(raw).model
        except (msgspec.DecodeError, msgspec.ValidationError):
            return self.default
        model = self.find(wanted) if isinstance(wanted, str) else self.default
        if model is None:
            raise model_not_found(str(wanted))
        if self.residency is None and not model.ready:
            raise model_unavailable(model)
        return model

    async def leased(self, model: ServedModel, vetted: Vetted, app: ASGIApp) -> ASGIApp:
        """`app` (the request's relay) holding its model loaded for its whole life; with
        residency, once the model is loaded (the request waits for it here, counted against
        its client's limits as a request waiting for a slot is)."""
        if self.residency is None:
            return app
        with model.relay.admission.reserved(vetted.client, vetted.sequences):
            release = await self.residency.acquire(model.name)
        return _Leased(app, release)

    # --- readiness --------------------------------------------------------------------------

    def required(self) -> list[ServedModel]:
        """The models the box is not ready without: the pinned ones (the default is, unless
        its table says pinned = false)."""
        return [model for model in self._models if model.entry.pinned]

    def not_ready(self) -> ServedModel | None:
        """The first model that must be up and is not; None while the box is ready."""
        return next((model for model in self.required() if not model.ready), None)

    def any_ready(self) -> bool:
        """Some model can serve now, or can be loaded for a request (residency)."""
        return self.residency is not None or any(model.ready for model in self._models)

    def detail(self, model: ServedModel) -> dict[str, Any]:
        """/health's entry for one model."""
        entry, engine = model.entry, model.engine
        detail: dict[str, Any] = {
            "state": engine.state.value, "pid": engine.pid, "ready": model.ready,
            "default": entry.default, "pinned": entry.pinned, "aliases": list(entry.aliases),
            "restarts": engine.snapshot().get("restarts")}
        if self.residency is not None:
            detail["residency"] = self.residency.snapshot(model.name)
        if (admission := model.relay.admission.model_detail()) is not None:
            detail["admission"] = admission
        return detail


class _Leased:
    """An ASGI app that holds its model's lease until it has answered (or failed)."""

    __slots__ = ("_app", "_release")

    def __init__(self, app: ASGIApp, release: Callable[[], None]) -> None:
        self._app, self._release = app, release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self._app(scope, receive, send)
        finally:
            self._release()


def model_not_found(name: str) -> NotFound:
    return NotFound(f"The model '{name}' does not exist.", param="model", code="model_not_found",
                    reason="model_not_found")


def model_unavailable(model: ServedModel) -> EngineUnavailable:
    """The model's worker is not ready (the other models' requests are not held up by it)."""
    return EngineUnavailable(f"the engine of model '{model.name}' is "
                             f"{model.engine.state.value}; retry shortly",
                             code="engine_unavailable", retry_after_s=model.engine.retry_after_s(),
                             reason="engine_unavailable")
