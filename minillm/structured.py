"""Structured output: a grammar decides, token by token, what a request may generate (vLLM's
``structured_outputs``; the server's ``response_format``). Shared by every rung: the one sampler
masks the logits (``sampling.py``), the one commit point advances the grammar (``Request.commit``).

The grammar engine is xgrammar (PyPI ``xgrammar``). A request's ``StructuredOutputsParams`` is
checked when it is made (an invalid JSON schema or regex is a ``ValueError`` naming the problem);
``Engine.validate`` compiles it once for the engine's tokenizer (``bind_grammar``: compiled
grammars are cached by (kind, spec)) and gives the request a ``GrammarState``: one
``GrammarMatcher`` per sample, so n > 1 samples each follow the grammar on their own. Each step,
``apply_grammar_masks`` fills the token bitmask of every constrained row of the batch and sets
the forbidden logits to -inf in place, before the controls and the draw; the matcher then
advances only on the token that is *committed*, so a preempted request (its tokens kept, its K/V
recomputed) needs nothing: its matcher already stands after its last committed token. A request
whose grammar is complete (the JSON closed, the choice made) ends with finish reason "stop".
"""
from __future__ import annotations

import importlib.util
import json
import re
import threading
from dataclasses import dataclass

import torch

KINDS = ("json", "regex", "choice", "json_object")
MAX_GRAMMARS = 256          # compiled grammars kept per tokenizer (a schema is compiled once)


def have_xgrammar() -> bool:
    return importlib.util.find_spec("xgrammar") is not None


def _xgrammar():
    if not have_xgrammar():   # requirements.txt installs it wherever PyPI has a wheel
        raise ValueError("structured_outputs needs the xgrammar package, which is not installed "
                         "here (pip install xgrammar)")
    import xgrammar
    return xgrammar


def _problem(e: Exception) -> str:
    """xgrammar's message without its C++ prefix ("[18:20:30] /project/cpp/x.cc:83: ...")."""
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", str(e).strip()).splitlines()[0]


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What the output must match (vLLM's names; set exactly one): ``json`` a JSON schema (a dict
    or its text), ``regex`` a regular expression, ``choice`` one of these strings, or
    ``json_object=True`` any JSON object. ``disable_any_whitespace`` (vLLM's): JSON without
    whitespace between its tokens, which keeps a small model from filling ``max_tokens`` with
    newlines. Checked when made: an invalid schema or regex is a ``ValueError`` naming it."""

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self):
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(KINDS)}, "
                             f"got {given or 'none'}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(f"structured_outputs.disable_any_whitespace must be True or False, "
                             f"got {self.disable_any_whitespace!r}")
        getattr(self, f"_check_{given[0]}")()
        self.grammar()     # xgrammar parses it: a schema it cannot follow is refused here

    def _set(self, name: str, value) -> None:
        object.__setattr__(self, name, value)   # only while checking: the object is frozen

    def _check_json(self) -> None:
        spec = self.json
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        if not isinstance(spec, (dict, bool)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (an object), got "
                             f"{spec!r:.80}")
        # one text per schema (the cache key), its key order kept: properties come in that order
        self._set("json", json.dumps(spec))

    def _check_regex(self) -> None:
        if not isinstance(self.regex, str) or not self.regex:
            raise ValueError(f"structured_outputs.regex must be a non-empty string, got "
                             f"{self.regex!r:.80}")

    def _check_choice(self) -> None:
        choice = self.choice
        if isinstance(choice, str) or not isinstance(choice, (list, tuple)) or not choice or \
                not all(isinstance(c, str) and c for c in choice):
            raise ValueError(f"structured_outputs.choice must be a list of non-empty strings, got "
                             f"{choice!r:.80}")
        self._set("choice", tuple(choice))

    def _check_json_object(self) -> None:
        if self.json_object is not True:
            raise ValueError(f"structured_outputs.json_object must be True, got "
                             f"{self.json_object!r}")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple:
        """(kind, spec, whitespace): what a compiled grammar is cached by."""
        return self.kind, getattr(self, self.kind), self.disable_any_whitespace

    def grammar(self):
        """The xgrammar ``Grammar`` (tokenizer-free); a ValueError naming what xgrammar refused."""
        xgr, kind = _xgrammar(), self.kind
        try:
            if kind == "regex":
                return xgr.Grammar.from_regex(self.regex)
            if kind == "choice":   # JSON string literals are EBNF's (escapes included)
                alts = " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice)
                return xgr.Grammar.from_ebnf(f"root ::= {alts}")
            schema = self.json if kind == "json" else '{"type": "object"}'
            return xgr.Grammar.from_json_schema(schema, **self._whitespace())
        except RuntimeError as e:
            raise ValueError(f"structured_outputs.{kind}: invalid {kind.replace('_', ' ')}: "
                             f"{_problem(e)}") from None

    def _whitespace(self) -> dict:
        return {"any_whitespace": not self.disable_any_whitespace}

    @classmethod
    def coerce(cls, value) -> "StructuredOutputsParams":
        """Accept the object or a dict of its fields (unknown keys are an error)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - set(cls.__dataclass_fields__), key=str)
            if unknown:
                raise ValueError(f"unknown structured_outputs field(s): "
                                 f"{', '.join(map(repr, unknown))}")
            return cls(**value)
        raise ValueError(f"structured_outputs must be a StructuredOutputsParams (or a dict of its "
                         f"fields), got {type(value).__name__}")


def tokenizer_info(tokenizer, vocab_size: int, stop_ids: list[int]):
    """What xgrammar must know of a vocabulary: each id's bytes, and which ids end the output.
    ``vocab_size`` is the model's (its logits may be wider than the tokenizer's vocabulary: the
    extra ids are never allowed). A tokenizer that is not Hugging Face's says each id's bytes
    itself (``token_bytes``, as the tiny model's byte tokenizer does)."""
    xgr = _xgrammar()
    if hasattr(tokenizer, "token_bytes"):
        return xgr.TokenizerInfo(tokenizer.token_bytes(vocab_size), xgr.VocabType.RAW,
                                 vocab_size=vocab_size, stop_token_ids=stop_ids)
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                              stop_token_ids=stop_ids)


class GrammarCompiler:
    """One tokenizer's compiled grammars, cached by ``StructuredOutputsParams.key``."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: list[int]):
        self.compiler = _xgrammar().GrammarCompiler(tokenizer_info(tokenizer, vocab_size, stop_ids))
        self.compiled: dict[tuple, object] = {}
        self.lock = threading.Lock()    # the server compiles on its tokenizer threads

    def compile(self, so: StructuredOutputsParams):
        with self.lock:
            if so.key not in self.compiled:
                if len(self.compiled) >= MAX_GRAMMARS:
                    self.compiled.pop(next(iter(self.compiled)))    # the oldest goes
                self.compiled[so.key] = self.compiler.compile_grammar(so.grammar())
            return self.compiled[so.key]


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


class GrammarState:
    """One request's grammar: a matcher per sample, made when the sample first needs a mask."""

    def __init__(self, compiled):
        self.compiled = compiled
        self.matchers: dict[int, object] = {}

    def matcher(self, sample: int):
        if sample not in self.matchers:
            self.matchers[sample] = _xgrammar().GrammarMatcher(self.compiled)
        return self.matchers[sample]

    def advance(self, sample: int, token: int) -> bool:
        """Sample ``sample`` committed ``token``; True when it must end: its grammar is
        complete, or the token broke it (only a bug could: the mask allowed it)."""
        m = self.matcher(sample)
        return not m.accept_token(token) or m.is_terminated()


def bind_grammar(req, tokenizer, vocab_size: int, stop_ids) -> None:
    """Give ``req`` its ``GrammarState`` (``Engine.validate``: before it is added)."""
    so = req.params.structured_outputs
    if so is not None and req.grammar is None:
        req.grammar = GrammarState(compiler_for(tokenizer, vocab_size, stop_ids).compile(so))


def row_matcher(req, sample: int):
    """The matcher that masks ``req``'s sample ``sample``, or None when it is unconstrained."""
    if req.params.structured_outputs is None:
        return None
    if req.grammar is None:     # silently unconstrained output would be worse than stopping
        raise RuntimeError(f"{req.request_id}: structured_outputs but no grammar: "
                           "Engine.validate(req) compiles it, before add_request")
    return req.grammar.matcher(sample)


def apply_grammar_masks(logits: torch.Tensor, matchers: list) -> None:
    """Set to -inf, in place, every logit a row's grammar forbids now; rows whose matcher is
    None are not touched. One bitmask (a bit per token) for the batch, filled row by row."""
    xgr = _xgrammar()
    rows = [i for i, m in enumerate(matchers) if m is not None]
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[-1])
    for i in rows:
        matchers[i].fill_next_token_bitmask(bitmask, i)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)


def mask_guessed_rows(logits: torch.Tensor, matcher, guesses: list[int]) -> None:
    """Speculative decoding under a grammar (rung 6): row ``i`` of ``logits`` [1 + k, vocab] is
    the target's distribution after ``guesses[:i]``, so it is masked with the grammar's state
    after those guesses. The matcher walks the guesses, then rolls back to where it stood: the
    commit advances it by the tokens actually kept. A guess the grammar refuses (or a complete
    grammar) ends the walk: the rows after it are never read, since the acceptance rule stops
    at that guess -- which its masked row cannot choose -- and keeps the target's own token."""
    xgr = _xgrammar()
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[-1])
    rows, walked = [], 0
    for i in range(logits.shape[0]):
        if matcher.is_terminated():
            break
        matcher.fill_next_token_bitmask(bitmask, i)
        rows.append(i)
        if i == len(guesses) or not _allowed(bitmask, i, guesses[i]) \
                or not matcher.accept_token(guesses[i]):
            break
        walked += 1
    if walked:
        matcher.rollback(walked)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)


def _allowed(bitmask: torch.Tensor, row: int, token: int) -> bool:
    """Does ``row`` of a filled bitmask (32 tokens per int32) allow ``token``? Asked before
    ``accept_token``, which would log a warning for every refused guess."""
    if not 0 <= token < bitmask.shape[1] * 32:
        return False
    return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)
