"""Pagoda: an LLM serving engine with a paged KV cache, a prompt cache and one-step lookahead decode."""
from engine.config import EngineConfig
from engine.llm import LLM, RequestOutput
from engine.core.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "EngineConfig"]
