"""What routes share, and the routes no API family owns.

Shared: `generation` (the builders of a generated route and of a pass-through), `handlers`
(`get`/`post`: use them, not litestar's; a test holds every route to it), `guards` (the key
guard, the engine-ready guard; both on routers). Own routes: `ops` (health, metrics, livez);
reload is not a route (the supervisor's control socket, supervisor/operator/control.py). Each API family's
routes live in its folder under appliance/apis/. Route metadata is declared on the handler:
`opt={"quiet": True}` keeps polled routes out of the access log; `opt={"shape": ...}` picks
the error shape.
"""
