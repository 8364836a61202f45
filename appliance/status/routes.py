"""The status page and chat playground for people (/, its script and style), and its data.

The page is a shell: static HTML, JS and CSS shipped in appliance/status/ui/, read once at start,
holding no data, so it is open like /livez. Everything it shows comes from /status.json,
guarded like /health (open, or behind the key with server.protect_ops_routes), and from the
/v1 routes it calls with the key the person typed, which stays in the browser.
"""

from __future__ import annotations

from importlib.resources import files

from litestar import Response
from litestar.handlers import HTTPRouteHandler

from appliance.routes.handlers import get
from appliance.status.document import StatusSources, status_document

QUIET = {"quiet": True}  # the page polls: an access line each would drown the log
# Litestar appends "; charset=utf-8" to every text/* media type itself.
_ASSETS = {"index.html": "text/html", "chart.js": "text/javascript",
           "status.js": "text/javascript", "status.css": "text/css"}
# The page may load only its own script, style and data: no CDN, nothing inline, no frames.
_PAGE_HEADERS = {
    "content-security-policy": "default-src 'self'; img-src 'self' data:; "
                               "frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}


def data_routes(sources: StatusSources) -> list[HTTPRouteHandler]:
    """/status.json: always 200 while the API runs, whatever the engine's state; scripts read
    `engine.state` (a page that polls must not see errors while the engine restarts)."""

    @get("/status.json", opt=QUIET, sync_to_thread=False)
    def status_json() -> Response[dict[str, object]]:
        return Response(content=status_document(sources), headers={"cache-control": "no-store"})

    return [status_json]


def page_routes() -> list[HTTPRouteHandler]:
    """The shell and its assets; open, since they hold no data."""
    assets = {name: files("appliance.status").joinpath("ui", name).read_bytes() for name in _ASSETS}

    def asset(name: str) -> Response[bytes]:
        return Response(content=assets[name], media_type=_ASSETS[name], headers=_PAGE_HEADERS)

    @get("/", sync_to_thread=False)
    def page() -> Response[bytes]:
        return asset("index.html")

    @get("/ui/status.js", sync_to_thread=False)
    def script() -> Response[bytes]:
        return asset("status.js")

    @get("/ui/chart.js", sync_to_thread=False)
    def chart() -> Response[bytes]:
        return asset("chart.js")

    @get("/ui/status.css", sync_to_thread=False)
    def style() -> Response[bytes]:
        return asset("status.css")

    return [page, script, chart, style]
