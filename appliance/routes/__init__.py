"""The API's routes, one module per family; each module's `routes(deps)` returns its handlers.

Adding a generation route: describe it in appliance/apis.py and add one handler to the family's
module (openai.py), built with `generation(...)` so auth, admission, policy and the relay come
with it. Route metadata is declared on the handler: `opt={"quiet": True}` keeps polled routes
out of the access log; `opt={"shape": ...}` picks the error shape.
"""
