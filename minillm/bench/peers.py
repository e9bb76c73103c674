"""The two Hugging Face baselines the benchmark measures our engines against.

* ``hf-static`` (``run_hf_static``): ``model.generate`` on left-padded static batches of up to
  ``batch_size`` requests. This is what most people write first, so it is the bar every engine on
  the ladder must clear. Like our static engine, a batch runs until its longest request is done and
  newcomers wait for the whole batch.
* ``hf-generate-batch`` (``run_hf_generate_batch``): transformers' own continuous batching (the
  manager behind ``model.generate_batch``: paged KV cache, requests join and leave every step).
  It is the peer our paged engine must beat.

Both take the same ``list[Request]`` workload (arrivals included) and return the same ``RunResult``
as ``Engine.run``. Limits: one set of sampling settings for the whole workload, no per-request
seeds, no ``n > 1`` or beam search; ``hf-generate-batch`` records no KV step records (``steps=[]``).
"""
from __future__ import annotations

import dataclasses
import math
import time
from collections import deque

import torch
from tqdm.auto import tqdm
from transformers import (ContinuousBatchingConfig, GenerationConfig, LogitsProcessor,
                          LogitsProcessorList)

from ..runtime.driver import RunResult
from ..engines.padded import left_pad
from ..memory import rectangle_counts
from ..metrics import StepRecord, summarize
from ..models import LoadedModel
from ..request import FinishReason, Request, RequestOutput


def _check(requests: list[Request]) -> dict:
    """Reject what the peers cannot run; return the HF sampling kwargs shared by all requests."""
    for r in requests:
        if r.params.n > 1 or r.params.beam_width > 1:
            raise ValueError(f"{r.request_id}: the HF peers do not run n > 1 or beam search")
    settings = {(r.params.temperature, r.params.top_p, r.params.top_k) for r in requests}
    if len(settings) > 1:
        raise ValueError("the HF peers need one temperature/top_p/top_k for the whole workload")
    temperature, top_p, top_k = settings.pop() if settings else (0.0, 1.0, 0)
    if temperature == 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": top_k}


def _stop_set(model: LoadedModel, req: Request) -> list[int]:
    """Token ids that end ``req``: EOS (unless ignore_eos) and its stop tokens."""
    eos = set() if req.params.ignore_eos else model.eos_token_ids
    return sorted(eos | set(req.params.stop_token_ids))


def _finish(model: LoadedModel, req: Request, tokens: list[int], times: list[float]) -> None:
    """Keep ``tokens`` up to the first stop (EOS, stop token, max_tokens).
    ``times[i]`` is when token i was made."""
    if not tokens:
        return
    landed, reason = req.commit(0, tokens, model.eos_token_ids, model.max_model_len, now=times[0])
    req.finish(reason or FinishReason.LENGTH, now=times[min(landed, len(times)) - 1])


def _outputs(model: LoadedModel, name: str, requests: list[Request], steps: list[StepRecord],
             duration: float) -> RunResult:
    outputs = [RequestOutput.from_request(
        r, model.tokenizer.decode(r.output_token_ids, skip_special_tokens=True)) for r in requests]
    return RunResult(outputs, summarize(name, outputs, steps, duration, model.kv_bytes_per_token),
                     steps)


# --- hf-static: generate() on padded static batches --------------------------------------------
class _StepClock(LogitsProcessor):
    """Called once per generated token, right after the forward that produced its logits."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return scores


def _run_static_batch(model: LoadedModel, batch: list[Request], sampling: dict, t0: float,
                    first_step: int) -> list[StepRecord]:
    ids, mask = left_pad([r.prompt_token_ids for r in batch], model.pad_token_id, model.device)
    width = ids.shape[1]
    max_new = min(max(r.params.max_tokens for r in batch), model.max_model_len - width)
    # HF stops a row at eos_token_id; rows that ignore EOS need generate to stop at nothing.
    eos = None if any(r.params.ignore_eos for r in batch) else sorted(model.eos_token_ids)
    clock = _StepClock()
    start = time.perf_counter()
    with torch.inference_mode():
        seqs = model.hf_model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max(max_new, 1),
            eos_token_id=eos, pad_token_id=model.pad_token_id,
            logits_processor=LogitsProcessorList([clock]), **sampling)
    for row, req in zip(seqs[:, width:].tolist(), batch):
        _finish(model, req, row, clock.times)
    steps = []
    for k, now in enumerate(clock.times):
        live = [r for r in batch if len(r.output_token_ids) > k]
        ms = (now - (clock.times[k - 1] if k else start)) * 1000.0
        steps.append(StepRecord(
            step=first_step + k, time_s=now - t0, prefill_ms=ms if k == 0 else 0.0,
            decode_ms=ms if k else 0.0, batch_size=len(batch),
            num_prefill_tokens=sum(r.prompt_len for r in batch) if k == 0 else 0,
            num_decode_tokens=len(live) if k else 0, num_running=len(batch),
            kv=rectangle_counts([(r.request_id, 0, r.prompt_len + k, 0) for r in live],
                                width + k, model.kv_bytes_per_token, num_rows=len(batch))))
    return steps


def run_hf_static(model: LoadedModel, requests: list[Request], batch_size: int = 32,
                  progress: bool = False) -> RunResult:
    """HF ``generate`` on static batches: take up to ``batch_size`` arrived requests, run them all
    to the end (``max_new_tokens`` = the batch's largest ``max_tokens``), then take the next."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    sampling = _check(requests)
    t0 = time.perf_counter()
    pending = deque(sorted(requests, key=lambda r: r.arrival_offset_s))
    steps: list[StepRecord] = []
    bar = tqdm(total=len(requests), desc="hf-static", unit="req", disable=not progress, leave=False)
    while pending:
        time.sleep(max(0.0, pending[0].arrival_offset_s - (time.perf_counter() - t0)))
        batch = []
        while pending and len(batch) < batch_size and \
                pending[0].arrival_offset_s <= time.perf_counter() - t0:
            batch.append(pending.popleft())
            batch[-1].arrival_time = t0 + batch[-1].arrival_offset_s
        steps += _run_static_batch(model, batch, sampling, t0, len(steps) + 1)
        bar.update(len(batch))
    bar.close()
    return _outputs(model, "hf-static", requests, steps, time.perf_counter() - t0)


# --- hf-generate-batch: transformers' continuous batching ---------------------------------------
def _cb_config(model: LoadedModel, requests: list[Request], page_size: int,
               max_batch_tokens: int, kv_cache_bytes: int) -> ContinuousBatchingConfig:
    """Size the paged cache for the workload, within the byte budget our paged engine gets.
    HF's own sizing takes a share of free device memory: on CPU that is most of the RAM, plus an
    sdpa attention mask as wide as the whole cache. Holding every request at once avoids
    evictions, which would re-prefill a request and lose its early per-token timestamps."""
    need = sum(math.ceil((r.prompt_len + r.params.max_tokens) / page_size) for r in requests)
    budget = kv_cache_bytes // (page_size * model.kv_bytes_per_token)
    # transformers calls the cache block's size ``block_size`` in 5.17, ``page_size`` in 5.23
    # (requirements.txt allows both)
    names = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    size = {"page_size" if "page_size" in names else "block_size": page_size}
    return ContinuousBatchingConfig(**size, num_blocks=max(1, min(need + 1, budget)),
                                    max_batch_tokens=max_batch_tokens)


def run_hf_generate_batch(model: LoadedModel, requests: list[Request], progress: bool = False,
                          page_size: int = 16, max_batch_tokens: int = 1024,
                          kv_cache_bytes: int = 1 << 30) -> RunResult:
    """transformers' continuous batching manager, fed each request when its arrival time comes,
    with its own ``max_new_tokens`` and stop tokens. Greedy unless the workload samples. The
    defaults mirror our paged engine's (16-token blocks, 1024-token batches, 1 GiB of KV)."""
    gen_config = GenerationConfig(**_check(requests), eos_token_id=sorted(model.eos_token_ids),
                                  pad_token_id=model.pad_token_id)
    cb_config = _cb_config(model, requests, page_size, max_batch_tokens, kv_cache_bytes)
    attn = model.config._attn_implementation  # the manager may switch it (to flash, on GPU)
    manager = model.hf_model.init_continuous_batching(generation_config=gen_config,
                                                      continuous_batching_config=cb_config)
    try:
        manager.warmup()  # CUDA graphs where used (a no-op on CPU): setup, like building an engine
        manager.start()
        return _serve(model, manager, requests, progress)
    finally:
        manager.destroy()  # stops the loop if it runs
        if model.config._attn_implementation != attn:
            model.hf_model.set_attn_implementation(attn)


def _serve(model: LoadedModel, manager, requests: list[Request], progress: bool) -> RunResult:
    t0 = time.perf_counter()
    pending = deque(sorted(requests, key=lambda r: r.arrival_offset_s))
    by_id = {r.request_id: r for r in requests}
    left = len(requests)
    bar = tqdm(total=left, desc="hf-generate-batch", unit="req", disable=not progress, leave=False)
    while left:
        while pending and pending[0].arrival_offset_s <= time.perf_counter() - t0:
            req = pending.popleft()
            req.arrival_time = t0 + req.arrival_offset_s
            manager.add_request(req.prompt_token_ids, request_id=req.request_id,
                                max_new_tokens=req.params.max_tokens, record_timestamps=True,
                                eos_token_id=_stop_set(model, req))
        wait = pending[0].arrival_offset_s - (time.perf_counter() - t0) if pending else 1.0
        result = manager.get_result(timeout=max(wait, 1e-3))
        if result is None:
            if not manager.is_running() or manager.background_thread_status.fatal_error:
                raise RuntimeError("transformers' continuous batching loop stopped: "
                                   f"{manager.background_thread_status.fatal_error!r}")
            continue
        if not result.is_finished():
            continue
        req = by_id[result.request_id]
        if result.error is not None:
            req.finish(FinishReason.ERROR, error=result.error)
        else:  # perf_counter() stamps per token (a request evicted and recomputed loses some)
            _finish(model, req, list(result.generated_tokens),
                    result.timestamps or [result.lifespan[1]])
        left -= 1
        bar.update(1)
    bar.close()
    return _outputs(model, "hf-generate-batch", requests, [], time.perf_counter() - t0)


# --- the benchmark's entry points: (model, requests, options, progress) -> RunResult --------------
def hf_static(model: LoadedModel, requests: list[Request], options: dict,
              progress: bool = False) -> RunResult:
    """``hf-static`` at the benchmark's ``batch_size`` (default 32)."""
    return run_hf_static(model, requests, options.get("batch_size", 32), progress)


def hf_generate_batch(model: LoadedModel, requests: list[Request], options: dict,
                      progress: bool = False) -> RunResult:
    return run_hf_generate_batch(model, requests, progress)
