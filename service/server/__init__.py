"""The ASGI and uvicorn plumbing under the routes: the request budget, problem+json
errors, the serving routes' short way, deadlines, joined writes, database faults, request
metrics and the metrics listener. Knows HTTP, not the domain's routes."""
