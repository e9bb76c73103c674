"""Compiling a structured-output grammar for one tokenizer: ``structured.py`` says what a grammar
is, this module turns it into xgrammar's ``CompiledGrammar`` (the token masks of every state).

A compile reads the whole vocabulary for each state of the grammar: milliseconds for a small
schema, seconds for a big one. So each tokenizer's compiled grammars are cached by
``StructuredOutputsParams.key`` and bounded (``MAX_GRAMMARS`` of them and ``MAX_CACHE_BYTES`` of
masks; the least recently used go first), and a grammar asked for while it compiles is compiled
once: the second caller waits for the first one's result. xgrammar's own cache is off: it keeps
every grammar it ever compiled. The server compiles in threads of its own, with a time bound
(``serve/grammar.py``); offline, ``Engine.validate`` compiles here directly.

A grammar that admits no string (regex ``[^\\s\\S]``) is refused here, a ``FieldError``: its
first mask allows no token. (A JSON schema that no value satisfies, ``{"$ref": "#"}``, is refused
sooner: xgrammar will not parse it, ``StructuredOutputsParams.grammar``.) One that runs into a dead end later (after a
few tokens) is caught where rows are sampled (``structured.apply_grammar_masks``).
"""
from __future__ import annotations

import importlib.util
import threading
from collections import OrderedDict
from concurrent.futures import Future
from typing import Protocol

import torch

from .checks import FieldError


class GrammarSpec(Protocol):
    """What the compiler needs of a request's grammar (``structured.StructuredOutputsParams``
    fills it; named here so that this module does not import the one that imports it)."""

    key: tuple          # what makes two specs the same grammar
    field: str          # the request field it came from, for errors

    def grammar(self):  # xgrammar's Grammar
        ...


MAX_GRAMMARS = 256              # compiled grammars kept per tokenizer
MAX_CACHE_BYTES = 512 * 2**20   # and their masks' bytes (a 10,000-way choice: ~7 MB for SmolLM2)


def have_xgrammar() -> bool:
    return importlib.util.find_spec("xgrammar") is not None


def xgrammar():
    if not have_xgrammar():   # requirements.txt installs it wherever PyPI has a wheel
        raise ValueError("structured_outputs needs the xgrammar package, which is not installed "
                         "here (pip install xgrammar)")
    import xgrammar as xgr
    return xgr


def tokenizer_info(tokenizer, vocab_size: int, stop_ids: list[int]):
    """What xgrammar must know of a vocabulary: each id's bytes, and which ids end the output.
    ``vocab_size`` is the model's (its logits may be wider than the tokenizer's vocabulary: the
    extra ids are never allowed). A tokenizer that is not Hugging Face's says each id's bytes
    itself (``token_bytes``, as the tiny model's byte tokenizer does)."""
    xgr = xgrammar()
    if hasattr(tokenizer, "token_bytes"):
        return xgr.TokenizerInfo(tokenizer.token_bytes(vocab_size), xgr.VocabType.RAW,
                                 vocab_size=vocab_size, stop_token_ids=stop_ids)
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                              stop_token_ids=stop_ids)


def allows_any(bitmask: torch.Tensor, rows: list[int], vocab_size: int) -> list[bool]:
    """For each of ``rows`` of a filled token bitmask (32 tokens per int32), whether it allows
    any token below ``vocab_size`` (the last word's bits past it are padding)."""
    full, rest = divmod(vocab_size, 32)
    words = bitmask[rows]
    found = (words[:, :full] != 0).any(dim=1)
    if rest:
        found |= (words[:, full] & ((1 << rest) - 1)) != 0
    return found.tolist()


class GrammarCompiler:
    """One tokenizer's compiled grammars, cached by ``StructuredOutputsParams.key``; safe to call
    from several threads (xgrammar's compiler is, and vLLM calls it from a pool too)."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: list[int]):
        xgr = xgrammar()
        self.compiler = xgr.GrammarCompiler(tokenizer_info(tokenizer, vocab_size, stop_ids),
                                            cache_enabled=False)
        self.vocab_size = vocab_size
        self.compiled: OrderedDict[tuple, Future] = OrderedDict()
        self.lock = threading.Lock()    # guards ``compiled`` only, never held while compiling

    def compile(self, so: GrammarSpec, wait_s: float | None = None):
        """``so``'s ``CompiledGrammar``, compiled now unless cached or compiling in another
        thread (then waited for: at most ``wait_s`` seconds, if given, before
        ``concurrent.futures.TimeoutError``). A grammar that cannot be compiled is a
        ``FieldError`` naming ``so.field``, remembered like a result."""
        future, mine = self._claim(so.key)
        if mine:
            self._run(so, future)
        return future.result(wait_s)

    def build(self, so: GrammarSpec):
        """Parse and compile ``so`` (the slow part: no lock is held); refuse a grammar that no
        string satisfies."""
        compiled = self.compiler.compile_grammar(so.grammar())
        if not self.first_token_allowed(compiled):
            raise FieldError(so.field, f"{so.field} admits no string: its grammar allows no "
                                       "first token, so no output could ever match it")
        return compiled

    def first_token_allowed(self, compiled) -> bool:
        xgr = xgrammar()
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask, 0)
        return allows_any(bitmask, [0], self.vocab_size)[0]

    def _claim(self, key: tuple) -> tuple[Future, bool]:
        """(the future of ``key``'s compile, whether this caller must run it)."""
        with self.lock:
            future = self.compiled.get(key)
            if future is not None:
                self.compiled.move_to_end(key)
                return future, False
            future = self.compiled[key] = Future()
            future.set_running_or_notify_cancel()     # a waiter cannot cancel it
            return future, True

    def _run(self, so: GrammarSpec, future: Future) -> None:
        try:
            compiled = self.build(so)
        except ValueError as e:         # the grammar's own fault: asked again, the same answer
            future.set_exception(e)
        except BaseException as e:      # anything else (out of memory...) is not remembered
            with self.lock:
                if self.compiled.get(so.key) is future:
                    del self.compiled[so.key]
            future.set_exception(e)
            raise
        else:
            future.set_result(compiled)
        self._trim()

    def _trim(self) -> None:
        """Drop the least recently used finished grammars beyond the cache's bounds."""
        with self.lock:
            done = [(k, f) for k, f in self.compiled.items() if f.done()]
            size = {k: f.result().memory_size_bytes if f.exception() is None else 0
                    for k, f in done}
            total = sum(size.values())
            for key, _ in done:
                if len(self.compiled) <= MAX_GRAMMARS and total <= MAX_CACHE_BYTES:
                    break
                del self.compiled[key]
                total -= size[key]


_compilers: dict[tuple[int, int], tuple[object, GrammarCompiler]] = {}
_compilers_lock = threading.Lock()


def compiler_for(tokenizer, vocab_size: int, stop_ids) -> GrammarCompiler:
    """The compiler of this tokenizer (made once: reading a 50k vocabulary takes a while)."""
    key = (id(tokenizer), vocab_size)
    with _compilers_lock:
        if key not in _compilers or _compilers[key][0] is not tokenizer:
            _compilers[key] = (tokenizer, GrammarCompiler(tokenizer, vocab_size,
                                                          sorted(stop_ids)))
        return _compilers[key][1]
