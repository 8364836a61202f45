"""The API's routes, one module per family; each module's `routes(deps)` returns its handlers.

Families: openai (chat, completions, the chat batch, /invocations, models), responses (the
Responses API), anthropic (Messages, under a router whose key guard also takes x-api-key),
tokenizer (tokenize, detokenize, tokenizer_info, version), ops (health, metrics, livez).

Adding a route that makes the engine work: describe it in appliance/apis.py and add one
handler to its family's module, built with `generation(...)` (openai.py) so auth, admission,
policy and the relay come with it. Any other route takes `get`/`post` from handlers.py, not
from litestar (a test holds every route to it). Route metadata is declared on the handler:
`opt={"quiet": True}` keeps polled routes out of the access log; `opt={"shape": ...}` picks
the error shape.
"""
