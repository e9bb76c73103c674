"""minillm: an LLM inference engine built up in steps, from a naive loop to paged attention.

Start with ``LLM`` and ``SamplingParams`` (as in vLLM); the steps live in ``minillm.engines``.
"""
from .llm import LLM
from .models import load_model
from .request import FinishReason, Request, RequestError, RequestOutput, SamplingParams

__all__ = ["LLM", "SamplingParams", "Request", "RequestOutput", "RequestError", "FinishReason",
           "load_model"]
