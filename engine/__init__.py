"""Pagoda: an LLM serving engine with a paged KV cache, a prompt cache and one-step lookahead decode."""
from engine.config import EngineConfig
from engine.core.sampling import SamplingParams
from engine.llm import LLM, CompletionOutput, RequestOutput

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineConfig"]
