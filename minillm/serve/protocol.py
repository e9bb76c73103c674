"""What comes over the wire: OpenAI's request shapes, and its error body (the response shapes are
in ``responses.py``). An error's ``param`` is always a field of the request (or a dotted path in
one): a refusal from ``SamplingParams`` names its field as data (``checks.FieldError``), which
``param_of`` maps to the field the client used.

Each endpoint has one explicit list of the fields it accepts, and every other field is a 400 that
names it: a client that asks for something minillm does not do (``tools``, ``suffix``...)
learns it at once instead of getting an answer that silently ignored
its request. The lists:

* honoured: the fields declared on the request models below (OpenAI's, among them ``logprobs``,
  ``echo``, ``top_logprobs``, the penalties, ``logit_bias`` and ``response_format``, plus vLLM's
  extras ``top_k``, ``min_p``, ``min_tokens``, ``repetition_penalty``, ``ignore_eos``,
  ``return_token_ids``, ``stop_token_ids``, ``structured_outputs``);
* ``IGNORED``: fields that only carry metadata and never change the answer (``user``...);
* ``REFUSED``: fields that would change the answer, accepted only with the value that changes
  nothing (``"tools": []``, ``"suffix": ""``...), which some clients send on every request;
* anything else (a typo, another server's extra): refused.
"""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import AllowInfNan, BaseModel, ConfigDict, Field, Strict, StrictBool, StrictInt
from pydantic import StrictStr

from ..checks import FIELD_RANGES, FieldError
from ..engines.r12_realtime.slo import MAX_SLO_MS
from ..request import SamplingParams
from ..sampling_params import MAX_LOGPROBS
from ..structured import StructuredOutputsParams


class APIError(Exception):
    """An error that becomes ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str | None = None, type: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


MAX_STOP_TOKEN_IDS = 256


# Strict types where JSON's lax coercions would hide a client bug: "3" is not a max_tokens, true is
# not a token id, "yes" is not a stream flag, "1" and true are not a temperature. A number field
# takes what OpenAI's schema calls a number: a JSON integer or float, finite (NaN and Infinity,
# which Python's JSON parser reads, are refused); an integer field a JSON integer only.
Number = Annotated[float, Strict(), AllowInfNan(False)]


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[StrictStr, list[TextPart]]   # OpenAI's content parts: text only here

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class JSONSchemaFormat(BaseModel):
    """OpenAI's ``response_format.json_schema``. ``strict`` is accepted either way: the schema is
    always followed exactly (xgrammar's strict mode: no properties beyond those declared)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: StrictStr
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")   # BaseModel has .schema
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object``, ``json_schema``."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class _Common(BaseModel):
    """Fields shared by both endpoints. OpenAI's defaults: 16 tokens (completions), temperature
    1. ``top_k``, ``ignore_eos``, ``return_token_ids``, ``stop_token_ids``, ``priority`` are vLLM's
    extras.
    Undeclared fields are kept (``extra="allow"``) so that ``check_fields`` can judge each one."""

    model_config = ConfigDict(extra="allow")
    IGNORED: ClassVar[frozenset[str]] = frozenset()      # set per endpoint below
    REFUSED: ClassVar[dict[str, tuple]] = {}

    model: StrictStr
    # Every integer is bounded here, with the engine's ranges (minillm/checks.py): a 400-digit
    # max_tokens is a 400 naming it, never a number that overflows inside the scheduler's step
    max_tokens: StrictInt | None = Field(default=None, ge=1, le=FIELD_RANGES["max_tokens"][1])
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1,
                                                    le=FIELD_RANGES["max_tokens"][1])
    temperature: Number = Field(default=1.0, ge=0.0, le=2.0)
    top_p: Number = Field(default=1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(default=0, ge=0, le=FIELD_RANGES["top_k"][1])  # vLLM's (0 = off)
    n: StrictInt = Field(default=1, ge=1, le=16)
    seed: StrictInt | None = Field(default=None, ge=FIELD_RANGES["seed"][0],
                                   le=FIELD_RANGES["seed"][1])
    stop: Union[StrictStr, list[StrictStr], None] = None
    stop_token_ids: list[StrictInt] | None = None      # vLLM's extra: these ids end a choice
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False                # benchmarks fix output lengths with it
    return_token_ids: StrictBool = False                # vLLM's extra: each choice's token ids too
    # vLLM's extra: lower runs first under --policy priority or score (engines/r8_policies); under
    # fcfs it only labels the request's class in /metrics
    priority: StrictInt = Field(default=0, ge=FIELD_RANGES["priority"][0],
                                le=FIELD_RANGES["priority"][1])
    # the sampler's controls (SamplingParams says what each does); null is "off"
    presence_penalty: Number | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: Number | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[StrictStr, Number] | None = None      # OpenAI's keys: token ids as text
    repetition_penalty: Number | None = Field(default=None, gt=0.0)   # vLLM's extras
    min_p: Number | None = Field(default=None, ge=0.0, le=1.0)
    min_tokens: StrictInt | None = Field(default=None, ge=0, le=FIELD_RANGES["max_tokens"][1])
    # structured output (minillm/structured.py): OpenAI's response_format, vLLM's
    # structured_outputs ({"json" | "regex" | "choice" | "json_object", "disable_any_whitespace"})
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    # rung 12: this request's objectives in ms (policy slo orders by their deadlines; None: its
    # priority's class in --slo-classes, else --slo-ttft-ms / --slo-tpot-ms); in (0, MAX_SLO_MS]
    ttft_slo_ms: Number | None = Field(default=None, gt=0, le=MAX_SLO_MS)
    tpot_slo_ms: Number | None = Field(default=None, gt=0, le=MAX_SLO_MS)

    def check_fields(self) -> None:
        """A 400 naming the first field that is neither honoured, nor metadata, nor neutral."""
        for name, value in (self.model_extra or {}).items():
            if name in self.IGNORED:
                continue
            if name in self.REFUSED:
                if any(same_json(value, v) for v in self.REFUSED[name]) or (
                        name == "best_of" and same_json(value, self.n)):
                    continue
                raise APIError(f"'{name}' is not supported by minillm (got {value!r:.60})",
                               param=name, code="unsupported_field")
            raise APIError(f"'{name}' is not supported by minillm: it is not a field of this "
                           "endpoint that minillm knows (see docs/SERVING.md, 'Fields')",
                           param=name, code="unsupported_field")

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4:
            raise APIError(f"at most 4 stop sequences are allowed, got {len(stops)}", param="stop")
        if any(not s for s in stops):
            raise APIError("stop sequences must be non-empty strings", param="stop")
        return stops

    def num_output_tokens(self, default: int) -> int:
        """max_completion_tokens, else max_tokens, else ``default`` (0 only for completions)."""
        return next((m for m in (self.max_completion_tokens, self.max_tokens) if m is not None),
                    default)

    def logprob_params(self) -> dict:
        """The ``SamplingParams`` log-probability fields this body asks for."""
        return {}

    def echo_prompt(self):
        """The prompt to echo before the output (completions' ``echo``), or None."""
        return None

    def bias(self, vocab_size: int) -> dict[int, float]:
        """``logit_bias`` with integer keys, each a token id of the vocabulary."""
        out = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise APIError(f"logit_bias: key {key!r} is not a token id", param="logit_bias") \
                    from None
            if not 0 <= token < vocab_size:
                raise APIError(f"logit_bias: token id {token} is outside the vocabulary "
                               f"[0, {vocab_size})", param="logit_bias")
            out[token] = value
        return out

    @property
    def wants_grammar(self) -> bool:
        """Whether this body asks for structured output (a grammar to parse and compile)."""
        fmt = self.response_format
        return bool(self.structured_outputs) or (fmt is not None and fmt.type != "text")

    def structured(self) -> StructuredOutputsParams | None:
        """``structured_outputs`` with ``response_format`` filled in (vLLM merges them the same
        way); a schema xgrammar refuses is a 400 naming the field the client used. Parses the
        grammar: the server calls it off the event loop (``serve/grammar.py``)."""
        fields = dict(self.structured_outputs or {})
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            fields["json_object"] = True
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise APIError("response_format of type json_schema needs json_schema.schema",
                               param="response_format")
            fields["json"] = fmt.json_schema.schema_
        try:
            return StructuredOutputsParams.coerce(fields) if fields else None
        except FieldError as e:
            raise APIError(str(e), param=self.param_of(e.field)) from None
        except (ValueError, TypeError) as e:    # what a check did not foresee: still a 400
            raise APIError(f"structured_outputs: {e}", param=self.param_of("structured_outputs")) \
                from None

    def param_of(self, field: str) -> str:
        """The field of this body that a ``SamplingParams`` field (a ``FieldError``'s or a
        ``RequestError``'s ``field``) came from: what an error's ``param`` names."""
        root = field.partition(".")[0]
        if root == "structured_outputs":
            fmt = self.response_format
            kind = field.partition(".")[2]
            if fmt is not None and fmt.type != "text" and kind in ("", "json", "json_object"):
                return "response_format"          # the client gave the grammar there
            return field
        if root == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return {"beam_width": "n"}.get(root, root)   # the server never asks for beams

    def sampling_params(self, default_max_tokens: int, vocab_size: int) -> SamplingParams:
        """The engine's ``SamplingParams``; a value it refuses becomes a 400 naming the field.
        ``max_tokens`` 0 (completions: the prompt's logprobs only, as lm-evaluation-harness asks)
        computes one token that the answer leaves out: it costs no extra forward pass, the
        prompt's last position gives it."""
        max_tokens = max(1, self.num_output_tokens(default_max_tokens))
        stop_ids = self.stop_token_ids or []
        if len(stop_ids) > MAX_STOP_TOKEN_IDS:   # each is checked against every new token
            raise APIError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed, got "
                           f"{len(stop_ids)}", param="stop_token_ids")
        bad = [t for t in stop_ids if not 0 <= t < vocab_size]
        if bad:
            raise APIError(f"stop_token_ids: token id {bad[0]} is outside the vocabulary "
                           f"[0, {vocab_size})", param="stop_token_ids")
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                top_k=self.top_k, seed=self.seed, n=self.n, ignore_eos=self.ignore_eos,
                stop_token_ids=stop_ids, presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=self.repetition_penalty or 1.0, min_p=self.min_p or 0.0,
                min_tokens=self.min_tokens or 0, logit_bias=self.bias(vocab_size),
                structured_outputs=self.structured(), **self.logprob_params())
        except FieldError as e:
            raise APIError(str(e), param=self.param_of(e.field)) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


# Fields that would change the answer -> the values that change nothing (null is OpenAI's "not
# set").
REFUSED_COMMON: dict[str, tuple] = {
    # vLLM's extras
    "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True),    # minillm always skips them in the text
}


class CompletionRequest(_Common):
    IGNORED = frozenset({"user"})
    REFUSED = {**REFUSED_COMMON, "suffix": (None, ""),
               "best_of": (None, 1)}       # best_of == n is also neutral (check_fields)

    prompt: Union[StrictStr, list[StrictInt], list[StrictStr], list[list[StrictInt]]]
    # 0: no output, only the prompt (with echo and logprobs: what lm-evaluation-harness scores)
    max_tokens: StrictInt | None = Field(default=None, ge=0, le=FIELD_RANGES["max_tokens"][1])
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)   # top k per token
    echo: StrictBool = False                  # the prompt (and its logprobs) before the output

    def logprob_params(self) -> dict:
        prompt = self.logprobs if self.echo else None   # echoed tokens get theirs too
        return {"logprobs": self.logprobs, "prompt_logprobs": prompt}

    def param_of(self, field: str) -> str:
        return "echo" if field == "prompt_logprobs" else super().param_of(field)

    def echo_prompt(self):
        return self.prompt_input() if self.echo else None

    def prompt_input(self):
        """One prompt: text or token ids (a one-element batch is unwrapped)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(f"batched prompts are not supported: send one prompt per request "
                               f"(got {len(p)})", param="prompt")
            p = p[0]
        if not p:
            raise APIError("prompt must not be empty", param="prompt")
        return p


class ChatCompletionRequest(_Common):
    # parallel_tool_calls only matters with tools, which are refused unless empty
    IGNORED = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls",
                         "prompt_cache_key", "safety_identifier"})
    REFUSED = {**REFUSED_COMMON,
               "tools": (None, []),
               "tool_choice": (None, "none", "auto"), "functions": (None, []),
               "function_call": (None, "none", "auto"), "modalities": (None, ["text"]),
               "audio": (None,), "prediction": (None,), "reasoning_effort": (None,),
               "web_search_options": (None,)}

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def logprob_params(self) -> dict:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
        return {"logprobs": (self.top_logprobs or 0) if self.logprobs else None}

    def param_of(self, field: str) -> str:
        if field in ("logprobs", "prompt_logprobs"):
            return "top_logprobs" if self.top_logprobs is not None else "logprobs"
        return super().param_of(field)

    def prompt_input(self):
        return [{"role": m.role, "content": m.text()} for m in self.messages]


def same_json(a: Any, b: Any) -> bool:
    """Equal as JSON values: 0 == 0.0, but true is not 1 and false is not 0."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    return type(a) is type(b) and a == b
