"""The OpenAI-compatible HTTP server: ``app.create_app`` (FastAPI wiring), ``routes/`` (one router
per concern), ``engine_view`` (the one read-only view of the engine's state), ``stats`` (``/stats``),
``page/`` (the page at ``/``), ``protocol`` (request and response bodies, error objects),
``metrics`` (Prometheus). ``hybridllm serve`` is in ``cli``."""
