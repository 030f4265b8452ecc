"""The HTTP API: the FastAPI app, its routers (each binds HTTP to the domain: parse
with a codec, call storage or serving, answer) and their typed dependencies, the
request and response schemas, and the body codecs (:mod:`service.api.codecs`, pure).
The plumbing under the routes (the request budget, problems, deadlines) is
:mod:`service.server`. Nothing below this package imports it."""
