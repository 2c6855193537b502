"""The OpenAI-compatible HTTP server: ``app.create_app`` (FastAPI), ``protocol`` (request and
response bodies, error objects), ``metrics`` (Prometheus). ``hybridllm serve`` is in ``cli``."""
