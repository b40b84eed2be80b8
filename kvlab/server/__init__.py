"""The OpenAI-compatible HTTP server (FastAPI + uvicorn, imported only when serving) and its metrics."""
