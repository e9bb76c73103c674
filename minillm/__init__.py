"""minillm: an LLM inference engine built up in steps, from a naive loop to paged attention.

Start with ``LLM`` and ``SamplingParams`` (as in vLLM); the steps live in ``minillm.engines``.
"""
# Triton picks native kernels or its CPU interpreter when it is first imported, and transformers
# imports it early (in load_model): without CUDA, choose the interpreter now, before that happens.
from .core.attention import choose_triton_mode

choose_triton_mode()
from .llm import LLM
from .models import load_model
from .request import FinishReason, Request, RequestError, RequestOutput, SamplingParams

__all__ = ["LLM", "SamplingParams", "Request", "RequestOutput", "RequestError", "FinishReason",
           "load_model"]
