"""Structured output: a grammar decides, token by token, what a request may generate (vLLM's
``structured_outputs``; the server's ``response_format``). Shared by every rung: the one sampler
masks the logits (``sampling.py``), the one commit point advances the grammar (``Request.commit``).

The grammar engine is xgrammar (PyPI ``xgrammar``). A request's ``StructuredOutputsParams`` is
checked when it is made (an invalid JSON schema or regex, or one over the size limits below, is
a ``ValueError`` naming the field); ``Engine.validate`` compiles it once for the engine's
tokenizer (``bind_grammar``; ``grammar_compiler.py`` caches compiled grammars and refuses one
that admits no string) and gives the request a ``GrammarState``: one ``GrammarMatcher`` per
sample, so n > 1 samples each follow the grammar on their own. Each step,
``apply_grammar_masks`` fills the token bitmask of every constrained row of the batch and sets
the forbidden logits to -inf in place, before the controls and the draw; the matcher then
advances only on the token that is *committed*, so a preempted request (its tokens kept, its K/V
recomputed) needs nothing: its matcher already stands after its last committed token. A request
whose grammar is complete (the JSON closed, the choice made) ends with finish reason "stop"; a
row whose grammar allows no token at all (a dead end) is not sampled: it gets ``NO_TOKEN`` and
its request ends with an error.

The size limits admit every grammar a person writes or a tool generates for a real task, and
refuse the ones whose parse or compile alone would take seconds to minutes (measured with
SmolLM2's 49,152-token vocabulary on a 2-core machine): ``MAX_CHOICES`` choices,
``MAX_GRAMMAR_BYTES`` of schema or choices, ``MAX_REGEX_BYTES`` of regex, ``MAX_SCHEMA_DEPTH``
levels of nesting.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

import torch

from .checks import FieldError
from .grammar_compiler import allows_any, compiler_for, xgrammar

KINDS = ("json", "regex", "choice", "json_object")
# A label set, every country, every language: hundreds to a few thousand. 10,000 compile in
# ~0.5 s; 20,000 take 2.4 s and 28 MB, 50,000 took 79 s. A longer list is a lookup table.
MAX_CHOICES = 10_000
# The biggest real schemas (tool definitions generated from an API spec) are tens of KB; 1,000
# required properties (46 KB) compile in 0.5 s. The same bound holds a choice list's bytes.
MAX_GRAMMAR_BYTES = 128 * 1024
# A regex people write (an e-mail address, a date, an identifier) is under 1 KB; a regex's
# compile grows with its length: 4 KB of character classes take 2.7 s, 16 KB 10 s.
MAX_REGEX_BYTES = 4 * 1024
# Levels of JSON nesting in a schema (a property one object down is two: "properties", then its
# name). Real schemas nest under 20; xgrammar's parse grows with the cube of the depth: 64 parse
# in 0.04 s, 130 in 0.24 s, 300 took 14 s.
MAX_SCHEMA_DEPTH = 64
NO_TOKEN = -1     # what a row whose grammar allows no token is given instead of a draw


def _problem(e: Exception) -> str:
    """xgrammar's message without its C++ prefix ("[18:20:30] /project/cpp/x.cc:83: ...")."""
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", str(e).strip()).splitlines()[0]


def nesting_depth(value, limit: int) -> int:
    """How deeply parsed JSON ``value`` nests objects and arrays, counted up to ``limit + 1``
    (iterative: no recursion limit, and a dict that contains itself ends the count too)."""
    deepest, stack = 0, [(value, 1)]
    while stack and deepest <= limit:
        item, depth = stack.pop()
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend((v, depth + 1) for v in item)
        else:
            continue
        deepest = max(deepest, depth)
    return deepest


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What the output must match (vLLM's names; set exactly one): ``json`` a JSON schema (a dict
    or its text), ``regex`` a regular expression, ``choice`` one of these strings, or
    ``json_object=True`` any JSON object. ``disable_any_whitespace`` (vLLM's): JSON without
    whitespace between its tokens, which keeps a small model from filling ``max_tokens`` with
    newlines. Checked when made: an invalid schema or regex, or one over the size limits, is a
    ``FieldError`` (a ValueError) naming the field (``structured_outputs.<kind>``)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self):
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise FieldError("structured_outputs", f"structured_outputs must set exactly one of "
                             f"{', '.join(KINDS)}, got {given or 'none'}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise FieldError("structured_outputs.disable_any_whitespace",
                             f"structured_outputs.disable_any_whitespace must be True or False, "
                             f"got {self.disable_any_whitespace!r}")
        getattr(self, f"_check_{given[0]}")()
        self.grammar()     # xgrammar parses it: a schema it cannot follow is refused here

    def _set(self, name: str, value) -> None:
        object.__setattr__(self, name, value)   # only while checking: the object is frozen

    def _check_json(self) -> None:
        spec = self.json
        if isinstance(spec, str):
            self._check_size(self._utf8_size(spec))
            try:
                spec = json.loads(spec)
            except (ValueError, RecursionError) as e:
                why = "it is nested too deeply" if isinstance(e, RecursionError) else e
                raise FieldError(self.field, f"structured_outputs.json is not valid JSON: "
                                             f"{why}") from None
        if not isinstance(spec, (dict, bool)):
            raise FieldError(self.field, f"structured_outputs.json must be a JSON schema (an "
                                         f"object), got {spec!r:.80}")
        depth = nesting_depth(spec, MAX_SCHEMA_DEPTH)
        if depth > MAX_SCHEMA_DEPTH:
            raise FieldError(self.field, f"structured_outputs.json nests more than "
                             f"{MAX_SCHEMA_DEPTH} levels deep, the limit (real schemas nest "
                             "under 20; parsing a deeper one takes seconds)")
        # one text per schema (the cache key), its key order kept: properties come in that order
        self._set("json", json.dumps(spec))
        self._check_size(len(self.json))       # ASCII: json.dumps escapes the rest

    def _check_regex(self) -> None:
        if not isinstance(self.regex, str) or not self.regex:
            raise FieldError(self.field, f"structured_outputs.regex must be a non-empty string, "
                                         f"got {self.regex!r:.80}")
        self._check_size(self._utf8_size(self.regex), MAX_REGEX_BYTES,
                         "a regex people write is under 1 KB; a longer one takes seconds to "
                         "compile")

    def _check_choice(self) -> None:
        choice = self.choice
        if isinstance(choice, str) or not isinstance(choice, (list, tuple)) or not choice or \
                not all(isinstance(c, str) and c for c in choice):
            raise FieldError(self.field, f"structured_outputs.choice must be a list of non-empty "
                                         f"strings, got {choice!r:.80}")
        if len(choice) > MAX_CHOICES:
            raise FieldError(self.field, f"structured_outputs.choice has {len(choice)} choices, "
                             f"more than the {MAX_CHOICES} allowed (a list that long is a lookup "
                             "table: its grammar would take seconds to compile and tens of MB "
                             "to keep)")
        self._check_size(sum(self._utf8_size(c) for c in choice))
        self._set("choice", tuple(choice))

    def _check_json_object(self) -> None:
        if self.json_object is not True:
            raise FieldError(self.field, f"structured_outputs.json_object must be True, got "
                                         f"{self.json_object!r}")

    def _utf8_size(self, text: str) -> int:
        """``text``'s size in UTF-8; text that is not valid Unicode (a lone surrogate, which a
        JSON body can spell as ``"\\ud800"``) is refused: no grammar engine can take it."""
        try:
            return len(text.encode("utf-8"))
        except UnicodeEncodeError as e:
            raise FieldError(self.field, f"{self.field} is not valid Unicode: {e.reason} at "
                                         f"position {e.start}") from None

    def _check_size(self, size: int, limit: int = MAX_GRAMMAR_BYTES,
                    why: str = "the largest real schemas are tens of KB; a bigger grammar takes "
                               "seconds to minutes to compile") -> None:
        if size > limit:
            raise FieldError(self.field, f"{self.field} is {size} bytes, more than the {limit} "
                                         f"allowed ({why})")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def field(self) -> str:
        """The field that holds the grammar, as errors name it: ``structured_outputs.<kind>``."""
        return f"structured_outputs.{self.kind}"

    @property
    def key(self) -> tuple:
        """(kind, spec, whitespace): what a compiled grammar is cached by."""
        return self.kind, getattr(self, self.kind), self.disable_any_whitespace

    def grammar(self):
        """The xgrammar ``Grammar`` (tokenizer-free); a FieldError naming what xgrammar refused."""
        xgr, kind = xgrammar(), self.kind
        try:
            if kind == "regex":
                return xgr.Grammar.from_regex(self.regex)
            if kind == "choice":   # JSON string literals are EBNF's (escapes included)
                alts = " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice)
                return xgr.Grammar.from_ebnf(f"root ::= {alts}")
            schema = self.json if kind == "json" else '{"type": "object"}'
            return xgr.Grammar.from_json_schema(schema, **self._whitespace())
        except RuntimeError as e:
            raise FieldError(self.field, f"structured_outputs.{kind}: invalid "
                             f"{kind.replace('_', ' ')}: {_problem(e)}") from None

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
                raise FieldError("structured_outputs", f"unknown structured_outputs field(s): "
                                 f"{', '.join(map(repr, unknown))}")
            return cls(**value)
        raise FieldError("structured_outputs", f"structured_outputs must be a "
                         f"StructuredOutputsParams (or a dict of its fields), got "
                         f"{type(value).__name__}")


class GrammarState:
    """One request's grammar: a matcher per sample, made when the sample first needs a mask.
    ``field``: where the request holds it (``StructuredOutputsParams.field``), for errors."""

    def __init__(self, compiled, field: str = "structured_outputs"):
        self.compiled, self.field = compiled, field
        self.matchers: dict[int, object] = {}

    def matcher(self, sample: int):
        if sample not in self.matchers:
            self.matchers[sample] = xgrammar().GrammarMatcher(self.compiled)
        return self.matchers[sample]

    def dead_end(self, generated: int) -> str:
        """Why a sample whose grammar allows no next token (it got ``NO_TOKEN``) fails."""
        return (f"{self.field}: the grammar allows no token after the {generated} token(s) "
                "generated so far: no string it admits starts with them")

    def advance(self, sample: int, token: int) -> bool:
        """Sample ``sample`` committed ``token``; True when it must end: its grammar is
        complete, or the token broke it (only a bug could: the mask allowed it)."""
        m = self.matcher(sample)
        return not m.accept_token(token) or m.is_terminated()


def bind_grammar(req, tokenizer, vocab_size: int, stop_ids) -> None:
    """Give ``req`` its ``GrammarState`` (``Engine.validate``: before it is added)."""
    so = req.params.structured_outputs
    if so is not None and req.grammar is None:
        req.grammar = GrammarState(compiler_for(tokenizer, vocab_size, stop_ids).compile(so),
                                   so.field)


def row_matcher(req, sample: int):
    """The matcher that masks ``req``'s sample ``sample``, or None when it is unconstrained."""
    if req.params.structured_outputs is None:
        return None
    if req.grammar is None:     # silently unconstrained output would be worse than stopping
        raise RuntimeError(f"{req.request_id}: structured_outputs but no grammar: "
                           "Engine.validate(req) compiles it, before add_request")
    return req.grammar.matcher(sample)


def apply_grammar_masks(logits: torch.Tensor, matchers: list) -> list[int]:
    """Set to -inf, in place, every logit a row's grammar forbids now; rows whose matcher is
    None are not touched. One bitmask (a bit per token) for the batch, filled row by row.
    Returns the rows whose grammar allows no token at all (a dead end): they must not be
    sampled (every logit is -inf: a draw would be garbage, a softmax NaN)."""
    xgr = xgrammar()
    rows = [i for i, m in enumerate(matchers) if m is not None]
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[-1])
    for i in rows:
        matchers[i].fill_next_token_bitmask(bitmask, i)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
    return [i for i, ok in zip(rows, allows_any(bitmask, rows, logits.shape[-1])) if not ok]


def mask_guessed_rows(logits: torch.Tensor, matcher, guesses: list[int]) -> bool:
    """Speculative decoding under a grammar (rung 6): row ``i`` of ``logits`` [1 + k, vocab] is
    the target's distribution after ``guesses[:i]``, so it is masked with the grammar's state
    after those guesses. The matcher walks the guesses, then rolls back to where it stood: the
    commit advances it by the tokens actually kept. A guess the grammar refuses (or a complete
    grammar) ends the walk: the rows after it are never read, since the acceptance rule stops
    at that guess -- which its masked row cannot choose -- and keeps the target's own token.
    Returns whether row 0 allows no token at all (a dead end): then nothing may be drawn."""
    xgr = xgrammar()
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
    return bool(rows) and not allows_any(bitmask, [0], logits.shape[-1])[0]


def _allowed(bitmask: torch.Tensor, row: int, token: int) -> bool:
    """Does ``row`` of a filled bitmask (32 tokens per int32) allow ``token``? Asked before
    ``accept_token``, which would log a warning for every refused guess."""
    if not 0 <= token < bitmask.shape[1] * 32:
        return False
    return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)
