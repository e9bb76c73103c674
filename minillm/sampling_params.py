"""``SamplingParams``: what a user asks of the sampler, checked once when it is made (vLLM's name and
fields). Shared by every rung; ``minillm.request`` re-exports it. The controls are applied by the
one sampler every rung uses (``minillm/sampling.py``), the log-probabilities computed by the
paged core (``core/sampler.py`` for generated tokens, ``core/runner.py`` for the prompt).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from .checks import INT32_MAX, FieldError, check_field, check_float, check_int
from .structured import StructuredOutputsParams

# Below this a temperature is treated as 0 (greedy), as vLLM does: dividing logits by 1e-38
# overflows to inf and the "sample" would be NaN garbage.
MIN_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20            # vLLM's default cap (``max_logprobs``): top-k beyond it is refused
MAX_LOGIT_BIAS = 300         # entries of logit_bias (OpenAI documents no cap; vLLM's own is 300)

# The fields that change the distribution beyond temperature/top-k/top-p, and those that ask for
# log-probabilities: an engine that cannot honour one refuses it by name (``Engine.validate``).
CONTROL_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p",
                  "min_tokens", "logit_bias")
LOGPROB_FIELDS = ("logprobs", "prompt_logprobs")
STRUCTURED_FIELDS = ("structured_outputs",)
NEUTRAL = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
           "min_p": 0.0, "min_tokens": 0, "logit_bias": (), "logprobs": None,
           "prompt_logprobs": None, "structured_outputs": None}


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. Temperature 0 means greedy (argmax), as in vLLM.

    ``seed`` makes sampling reproducible per request: the random draw for output token ``i`` depends
    only on (seed, i), never on which other requests happened to share the batch.

    Controls (vLLM's order: ``logit_bias``, ``min_tokens``, the penalties, then temperature,
    ``min_p``, top-k, top-p), each a per-row tensor operation over the batch:

    * ``presence_penalty`` / ``frequency_penalty`` (OpenAI's, in [-2, 2]): subtract
      ``presence * (count > 0) + frequency * count`` from a token's logit, counting the tokens
      this sample *generated*;
    * ``repetition_penalty`` (> 0, 1 = off; Hugging Face's and vLLM's): a token seen in the prompt
      or the output has its logit divided by it when positive, multiplied when negative;
    * ``min_p`` in [0, 1]: drop tokens whose probability is below ``min_p`` times the top one's;
    * ``min_tokens``: EOS and ``stop_token_ids`` are masked until that many tokens are generated;
    * ``logit_bias``: token id -> bias in [-100, 100] added to its logit (a dict, kept as sorted
      pairs so the object stays hashable).

    ``logprobs=k`` (0..20): each generated token's log-probability and the ``k`` most likely
    tokens', ``prompt_logprobs=k`` the same for each prompt token (the first is None), as dicts
    token id -> logprob that always hold the chosen token. They are vLLM's default "raw" mode: the
    ``log_softmax`` of the model's fp32 logits, *before* temperature, penalties and filters. A
    request asking ``prompt_logprobs`` never adopts blocks from the prefix cache (vLLM does the
    same): every prompt position must run through the model to have logits.

    ``structured_outputs`` (``minillm.structured.StructuredOutputsParams``, or a dict of its
    fields): a JSON schema, ``json_object``, a regex or a choice the output must match; the
    grammar's mask is applied to the logits before everything else (so logprobs are those of the
    masked distribution, as in vLLM), and the output ends ("stop") when the grammar is complete.

    Every field is checked, by type and by value, when the object is made: a bad one raises a
    ``ValueError`` naming the field and the value (a ``checks.FieldError``: its ``field`` names
    it for a program). The object is frozen, so it stays valid: to
    change a field, make a new one (``dataclasses.replace(params, seed=1)``, which checks again).
    Integer ranges (inclusive, ``FIELD_RANGES``): ``max_tokens`` 1..2**31-1, ``top_k``
    0..2**31-1, ``seed`` -2**63..2**63-1, ``n`` and ``beam_width`` 1..2**31-1, each of
    ``stop_token_ids`` and each ``logit_bias`` key 0..2**31-1.
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0           # 0 = no top-k limit (vLLM uses -1; we document 0)
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()   # any sequence of ids; kept as a tuple
    ignore_eos: bool = False
    n: int = 1               # parallel samples sharing one prompt (rung 3)
    beam_width: int = 1      # beam search (rung 3); 1 = off
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self):
        self._set("max_tokens", check_field("max_tokens", self.max_tokens))
        self._set("temperature", check_float("temperature", self.temperature))
        if self.temperature < 0:
            raise FieldError("temperature", f"temperature must be >= 0, got {self.temperature!r}")
        if self.temperature < MIN_TEMPERATURE:
            self._set("temperature", 0.0)
        self._set("top_p", check_float("top_p", self.top_p))
        if not 0 < self.top_p <= 1:
            raise FieldError("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        self._set("top_k", check_field("top_k", self.top_k))
        if self.seed is not None:
            self._set("seed", check_field("seed", self.seed))
        self._set("stop_token_ids", self._check_stop_ids(self.stop_token_ids))
        if not isinstance(self.ignore_eos, bool):
            raise FieldError("ignore_eos", f"ignore_eos must be True or False, got "
                                           f"{self.ignore_eos!r}")
        self._set("n", check_field("n", self.n))
        self._set("beam_width", check_field("beam_width", self.beam_width))
        if self.n > 1 and self.beam_width > 1:
            raise FieldError("n", f"n={self.n} and beam_width={self.beam_width}: choose "
                             "parallel sampling (n) or beam search (beam_width), not both")
        if self.beam_width > 1 and self.temperature > 0:
            raise FieldError("temperature", f"beam search is deterministic: beam_width="
                             f"{self.beam_width} needs temperature=0, got temperature="
                             f"{self.temperature!r}")
        self._check_logprobs()
        self._check_controls()
        self._check_structured()

    def _set(self, name: str, value) -> None:
        object.__setattr__(self, name, value)   # only while checking: the object is frozen

    def _check_logprobs(self) -> None:
        for name in LOGPROB_FIELDS:
            if getattr(self, name) is not None:
                self._set(name, check_int(name, getattr(self, name), 0, MAX_LOGPROBS))
        if self.logprobs is not None and self.beam_width > 1:
            raise FieldError("logprobs", f"logprobs={self.logprobs} needs beam_width=1: a beam's "
                             f"tokens are chosen by the search, got beam_width={self.beam_width}")

    def _check_controls(self) -> None:
        for name, low, high in (("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0),
                                ("min_p", 0.0, 1.0)):
            value = check_float(name, getattr(self, name))
            if not low <= value <= high:
                raise FieldError(name, f"{name} must be in [{low}, {high}], got {value!r}")
            self._set(name, value)
        self._set("repetition_penalty", check_float("repetition_penalty", self.repetition_penalty))
        if self.repetition_penalty <= 0:
            raise FieldError("repetition_penalty", f"repetition_penalty must be > 0, got "
                                                   f"{self.repetition_penalty!r}")
        self._set("min_tokens", check_int("min_tokens", self.min_tokens, 0, self.max_tokens))
        self._set("logit_bias", self._check_bias(self.logit_bias))
        used = [f for f in CONTROL_FIELDS if getattr(self, f) != NEUTRAL[f]]
        if used and self.beam_width > 1:
            raise FieldError(used[0], f"{used[0]}={getattr(self, used[0])!r} needs beam_width=1: "
                             f"beam search ranks raw log-probabilities, got beam_width="
                             f"{self.beam_width}")

    def _check_structured(self) -> None:
        so = self.structured_outputs
        if so is None:
            return
        self._set("structured_outputs", StructuredOutputsParams.coerce(so))
        if self.beam_width > 1:     # a beam would need a matcher per hypothesis, forked and ranked
            raise FieldError("structured_outputs", f"structured_outputs needs beam_width=1, got "
                             f"beam_width={self.beam_width}")
        if self.min_tokens:         # a complete grammar allows only EOS, which min_tokens forbids
            raise FieldError("min_tokens", f"min_tokens={self.min_tokens} cannot be combined "
                             "with structured_outputs: the grammar decides where the output ends")

    @staticmethod
    def _check_bias(bias) -> tuple[tuple[int, float], ...]:
        if not isinstance(bias, (dict, list, tuple)):
            raise FieldError("logit_bias", f"logit_bias must be a dict of token id -> bias, got "
                             f"{bias!r}")
        items = list(bias.items() if isinstance(bias, dict) else bias)
        if len(items) > MAX_LOGIT_BIAS:
            raise FieldError("logit_bias", f"logit_bias may hold at most {MAX_LOGIT_BIAS} "
                             f"entries, got {len(items)}")
        out = {}
        for pair in items:
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise FieldError("logit_bias", f"logit_bias must be a dict of token id -> bias, "
                                 f"got {pair!r}")
            token = check_int("logit_bias key", pair[0], 0, INT32_MAX, field="logit_bias")
            value = check_float(f"logit_bias[{token}]", pair[1], field="logit_bias")
            if not -100 <= value <= 100:
                raise FieldError("logit_bias", f"logit_bias[{token}] must be in [-100, 100], "
                                               f"got {value!r}")
            out[token] = value
        return tuple(sorted(out.items()))

    @staticmethod
    def _check_stop_ids(ids) -> tuple[int, ...]:
        if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple, set, frozenset)):
            raise FieldError("stop_token_ids", f"stop_token_ids must be a list of token ids, "
                             f"got {ids!r} ({type(ids).__name__})")
        return tuple(check_field("stop_token_ids[]", t, field="stop_token_ids") for t in ids)

    @classmethod
    def coerce(cls, params) -> "SamplingParams":
        """Accept a ``SamplingParams`` or a dict of its fields (unknown keys are an error)."""
        if isinstance(params, cls):
            return params
        if isinstance(params, dict):
            unknown = sorted(set(params) - {f.name for f in fields(cls)}, key=str)
            if unknown:
                raise ValueError(f"unknown SamplingParams field(s): {', '.join(map(repr, unknown))}")
            return cls(**params)
        raise ValueError(f"params must be a SamplingParams (or a dict of its fields), got "
                         f"{type(params).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_processing(self) -> bool:
        """Whether any control beyond temperature/top-k/top-p changes this row's logits."""
        return any(getattr(self, f) != NEUTRAL[f] for f in CONTROL_FIELDS)

    def fields_in_use(self) -> list[str]:
        """The controls, log-probability and structured-output fields set to something other than
        "off" (what an engine that cannot honour them refuses by name)."""
        return [f for f in CONTROL_FIELDS + LOGPROB_FIELDS + STRUCTURED_FIELDS
                if getattr(self, f) != NEUTRAL[f]]
