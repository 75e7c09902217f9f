"""The OpenAI-compatible HTTP server: `app.py` (routes), `protocol.py` (request and response
bodies), `async_engine.py` (the engine loop thread and per-request streams), `serving.py`
(completions and chat), `metrics.py` (Prometheus), `launcher.py` (uvicorn, graceful drain)."""
