"""The HTTP layer: the FastAPI app, its routers and dependencies, request and
response schemas, body parsing, and the one mapping of domain errors to RFC 9457
problems. Nothing below this package imports it."""
