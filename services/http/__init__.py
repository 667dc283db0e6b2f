"""The OpenAI-compatible HTTP front (FastAPI + uvicorn), run inside the worker beside gRPC."""
