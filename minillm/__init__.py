"""minillm: an LLM inference engine built up in steps, from a naive loop to paged attention.

Start with ``LLM`` and ``SamplingParams`` (as in vLLM); the steps live in ``minillm.engines``.
"""
# Triton picks native kernels or its CPU interpreter when it is first imported, and transformers
# imports it early (in load_model): without CUDA, choose the interpreter now, before that happens
# (core/attention/triton/__init__.py; importing it does not import triton itself).
from .core.attention import triton as _triton  # noqa: F401
from .llm import LLM
from .models import load_model
from .request import FinishReason, Request, RequestError, RequestOutput, SamplingParams

__all__ = ["LLM", "SamplingParams", "Request", "RequestOutput", "RequestError", "FinishReason",
           "load_model"]
