"""API keys, authentication of a request's key, and per-key limits."""
