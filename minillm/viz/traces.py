"""Traces of real engine runs, for the fragmentation visualizer to replay.

``Engine.run`` stamps each request with the step at which it was added (``Request.added_step``);
``trace_from_run`` (or ``record_paged_run``, which runs and traces) turns the run into a ``Trace``
(each request's prompt, its output lengths and tokens, the engine step at which it was added, the
engine's pool and limits; for beam search, each step's choice, which ``record_paged_run`` watches
with a ``BeamRecorder`` on ``engine.observers``), which ``Trace.save``/``load`` keep as JSON. ``replay_trace`` runs it through an allocator
(``replay.simulate``); through the paged one it reproduces the engine's own ``StepRecord`` counts
exactly. Used by notebook 05 (``05_fragmentation_visualizer``)
and ``visualizer.FragmentationVisualizer.load_trace``.
"""
from __future__ import annotations

import json
import dataclasses
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..engines.r8_policies.config import PolicyConfig
from ..engines.r8_policies.policy import Priority, Score
from ..engines.r12_realtime.config import RealtimeConfig
from ..engines.r12_realtime.slo import SLO
from ..runtime.observe import StepEvent
from ..llm import LLM
from ..request import Request
from .accounting import SimConfig, SimResult
from .replay import simulate
from ..workload import SimRequest


@dataclass
class Trace:
    """A paged engine run, reduced to what the allocator needs to reproduce it."""

    requests: list[SimRequest]            # in the order the engine added them
    block_size: int
    num_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    enable_prefix_caching: bool
    policy: str
    max_model_len: int
    bytes_per_slot: int
    engine_steps: list[dict] = field(default_factory=list)   # the engine's own StepRecords
    source: str = ""
    policy_options: dict = field(default_factory=dict)   # the policy's weights (score, priority)

    def config(self, **overrides) -> SimConfig:
        kw = dict(budget_slots=self.num_blocks * self.block_size, block_size=self.block_size,
                  max_num_batched_tokens=self.max_num_batched_tokens,
                  max_num_seqs=self.max_num_seqs, enable_prefix_caching=self.enable_prefix_caching,
                  policy=self.policy, policy_options=dict(self.policy_options),
                  max_model_len=self.max_model_len,
                  bytes_per_slot=self.bytes_per_slot, validate=False, idle_steps=False)
        kw.update(overrides)
        return SimConfig(**kw)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Trace":
        d = dict(d)
        d["requests"] = [SimRequest(**r) for r in d["requests"]]
        return cls(**d)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict()))
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        return cls.from_dict(json.loads(Path(path).read_text()))


class BeamRecorder:
    """An observer: each beam-search choice, by request id, as ``BeamChoice.to_list()``."""

    def __init__(self):
        self.choices: dict[str, list] = {}

    def __call__(self, event: StepEvent) -> None:
        if event.phase == "beam":
            self.choices.setdefault(event.request_id, []).append(event.data.to_list())


def trace_from_run(result, requests: list[Request], engine, source: str = "",
                   beam_choices: dict[str, list] | None = None) -> Trace:
    """A ``Trace`` of ``engine.run(requests)`` (a ``PagedEngine``; ``result`` is its RunResult).

    The engine itself recorded when each request was added (``Request.added_step``) and adds
    them in order of arrival (a stable sort), which is the order the trace keeps. A beam search
    replays from its choices (``beam_choices``, request id -> list: a ``BeamRecorder``'s, which
    ``record_paged_run`` keeps for you)."""
    from ..core.engine import PagedEngine
    from ..request import FinishReason as FR

    if not isinstance(engine, PagedEngine):
        raise TypeError(f"traces replay through the paged allocator: need a PagedEngine, "
                        f"got {type(engine).__name__}")
    outputs = {o.request_id: o for o in result.outputs}
    sims = []
    for req in sorted(requests, key=lambda r: r.arrival_offset_s):
        out = outputs.get(req.request_id)
        if out is None:
            raise ValueError(f"{req.request_id} was not added by Engine.run in this run: trace a "
                             "run of engine.run(requests) (or LLM.run)")
        if out.finish_reason == FR.ERROR:
            continue                                 # rejected by validate: never added
        if out.finish_reason == FR.ABORT:
            raise ValueError(f"{req.request_id} was aborted: traces of aborted runs are not supported")
        if req.added_step is None:
            raise ValueError(f"{req.request_id} was not added by Engine.run: trace a run of "
                             "engine.run(requests) (or LLM.run)")
        step = req.added_step
        choices = None
        if req.params.beam_width > 1:
            choices = (beam_choices or {}).get(req.request_id)
            if choices is None:
                raise ValueError(f"{req.request_id} is a beam search: its choices are needed to "
                                 "replay it; trace it with record_paged_run (it watches them)")
        samples = out.samples if out.samples else [out.token_ids]
        sims.append(SimRequest(req.request_id, list(req.prompt_token_ids),
                               [len(s) for s in samples], req.params.max_tokens, step,
                               req.priority, [list(s) for s in samples], req.params.beam_width,
                               choices))
    sched = engine.scheduler
    return Trace(sims, engine.block_size, engine.block_manager.num_blocks,
                 sched.max_num_batched_tokens, sched.max_num_seqs,
                 engine.block_manager.enable_prefix_caching, sched.policy.name,
                 engine.max_model_len, engine.kv_bytes_per_token,
                 [{"step": s.step, "num_running": s.num_running, **s.kv.as_dict()}
                  for s in result.steps], source, policy_options(sched.policy))


def policy_options(policy) -> dict:
    """The options that make ``policy`` again (``engines.build_components``), those that differ
    from their defaults: what a trace keeps of the policy's weights."""
    if isinstance(policy, Priority):
        given = {"priority_preemption_threshold": policy.threshold}
    elif isinstance(policy, Score):
        given = {"score_wait_weight": policy.wait_weight, "score_margin": policy.margin,
                 "score_remaining_weight": policy.remaining_weight,
                 "score_priority_weight": policy.priority_weight}
    elif isinstance(policy, SLO):
        classes = ",".join(f"{p}:{t:g}:{s:g}" for p, t, s in policy.classes) or None
        given = {"slo_ttft_ms": policy.ttft_ms, "slo_tpot_ms": policy.tpot_ms,
                 "slo_margin_ms": policy.margin_ms, "slo_classes": classes}
    else:
        return {}
    defaults = {f.name: f.default for config in (PolicyConfig, RealtimeConfig)
                for f in dataclasses.fields(config)}
    return {k: v for k, v in given.items() if v != defaults[k]}


def record_paged_run(llm_or_engine, requests: list[Request], on_step=None, progress: bool = False,
                     source: str = ""):
    """Run a paged engine and trace the run; return (RunResult, Trace).

    The engine must be fresh (no step run yet): a replay starts from an empty pool, and a used
    pool remembers its free-block order and, with prefix caching, its cached blocks."""
    engine = llm_or_engine.engine if isinstance(llm_or_engine, LLM) else llm_or_engine
    if engine.total_steps:
        raise ValueError("record a trace on a fresh engine (this one has already run "
                         f"{engine.total_steps} steps): create a new LLM/PagedEngine")
    with engine.observers.watching(BeamRecorder()) as beams:
        result = engine.run(requests, on_step=on_step, progress=progress)
    return result, trace_from_run(result, requests, engine, source, beams.choices)


def replay_trace(trace: Trace, allocator: str = "paged", **overrides) -> SimResult:
    """Run a recorded trace through an allocator. With ``paged`` and no overrides, every step's
    counts equal the engine's own StepRecords exactly."""
    return simulate(trace.requests, allocator, trace.config(**overrides))
