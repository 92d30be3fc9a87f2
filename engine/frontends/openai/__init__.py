"""Standalone OpenAI-compatible HTTP server (FastAPI), for any runner."""
