"""Structured output on the server: a request's grammar is parsed and compiled in threads of its
own, never on the event loop (every client shares it) nor on the tokenizer thread (every request
passes through it), and within a time bound.

Parsing a schema and compiling its masks for the vocabulary take milliseconds for the grammars
people write and seconds for huge ones; ``structured.py`` refuses the sizes that would take
longer (a 400 naming the field and the limit). What passes is compiled once
(``grammar_compiler.py`` caches it) by one of ``GRAMMAR_WORKERS`` threads, while the server goes
on answering everyone else; a request whose grammar is not ready within ``timeout_s`` (default
``COMPILE_TIMEOUT_S``) is a 400 that says so. xgrammar cannot interrupt a compile, so one that
overruns keeps its thread (and a core) until it ends, and a few grammars within the size limits
take minutes (a 40-byte schema whose string ``pattern`` is ``^[a-z]{1,50000}$``, 2,000 optional
properties in one object). So the pool is small, and such a grammar is compiled once however
often it is asked for: a request for it while it compiles waits for that compile (and its
result, once there, is kept for the next). A compile in a process of its own could be killed,
but bringing a big grammar back costs seconds (a 20,000-way choice: 30 MB of JSON, 8 s to write
and 3 s to read).
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from ..checks import FieldError
from ..grammar_compiler import compiler_for
from ..request import SamplingParams
from .protocol import APIError

GRAMMAR_WORKERS = 2   # one grammar that compiles for long leaves another thread to the rest
# The grammars people write compile in well under a second (the largest choice list the size
# limits admit: 0.5 s on a 2-core machine, for SmolLM2's vocabulary); 20 s leaves room for a
# machine busy with other work, and refuses the shapes whose compile explodes within the size
# limits (2,000 optional properties in one object: 64 s).
COMPILE_TIMEOUT_S = 20.0


class GrammarWorker:
    """The server's grammar threads for ``llm``'s tokenizer. ``params`` builds a body's
    ``SamplingParams`` and, when it asks for structured output, its compiled grammar."""

    def __init__(self, llm, timeout_s: float = COMPILE_TIMEOUT_S,
                 workers: int = GRAMMAR_WORKERS):
        if not timeout_s > 0:
            raise ValueError(f"the grammar compile timeout must be > 0 seconds, got {timeout_s!r}")
        self.llm, self.timeout_s = llm, timeout_s
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="minillm-grammar")

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def params(self, body, default_max_tokens: int) -> tuple[SamplingParams, object]:
        """(``body``'s SamplingParams, its CompiledGrammar or None); a 400 naming the field for
        a grammar that is invalid, too big, admits no string, or is not ready in time."""
        vocab = self.llm.model.config.vocab_size
        if not body.wants_grammar:   # nothing slow to do: no grammar to parse
            return body.sampling_params(default_max_tokens, vocab), None
        job = self.pool.submit(self._build, body, default_max_tokens, vocab)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(job), self.timeout_s)
        except asyncio.TimeoutError:
            raise self.too_slow(body) from None

    def _build(self, body, default_max_tokens: int, vocab: int):
        """On a grammar thread: parse (``SamplingParams`` checks the grammar), then compile."""
        params = body.sampling_params(default_max_tokens, vocab)
        engine = self.llm.engine
        compiler = compiler_for(engine.tokenizer, vocab, engine.eos_ids)
        try:
            return params, compiler.compile(params.structured_outputs, wait_s=self.timeout_s)
        except FieldError as e:
            raise APIError(str(e), param=body.param_of(e.field)) from None
        except FutureTimeout:   # the same grammar, compiling in another thread, overran
            raise self.too_slow(body) from None

    def too_slow(self, body) -> APIError:
        field = body.param_of(grammar_field(body))
        return APIError(f"{field}: the grammar was not compiled within {self.timeout_s:g} s, "
                        "this server's limit (its wait for a compile thread included): make it "
                        "smaller or simpler (fewer optional properties, choices, repetitions)",
                        param=field, code="grammar_too_slow")


def grammar_field(body) -> str:
    """The field that holds ``body``'s grammar, before it is parsed."""
    kinds = [k for k in ("json", "regex", "choice", "json_object")
             if (body.structured_outputs or {}).get(k) not in (None, False)]
    return f"structured_outputs.{kinds[0]}" if len(kinds) == 1 else "structured_outputs"
