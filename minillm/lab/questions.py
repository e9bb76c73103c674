"""Numeric questions of the notebooks' labs, checked against numbers the engine computes.

``lab.check("01.q3a", answer)`` in a notebook says whether an answer is right (within a tolerance)
without printing the expected value; the truth is computed from the model's configuration and the
package's own code each time, never typed in — but never by running a function an exercise asks
students to write (in a handout those are stubs): where a question is about such a function, the
truth is its definition's arithmetic, and ``tests/lab/test_lab.py`` checks that arithmetic against a
run of the package's own code. ``python -m minillm.lab answers`` prints the key for the teacher;
in a handout ``Question.truth()`` refuses, as ``answers`` does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable


@lru_cache(maxsize=1)
def smollm2_kv_geometry() -> tuple[int, int, int]:
    """(layers, KV heads, head_dim) of SmolLM2-135M, from its config."""
    from transformers import AutoConfig

    from ..models import ensure_smollm2_cache, kv_geometry
    return kv_geometry(AutoConfig.from_pretrained(ensure_smollm2_cache()))


def smollm2_kv_bytes_per_token(kv_cache_dtype: str = "auto") -> int:
    """K and V of one token across every layer of SmolLM2-135M (fp32, or as ``kv_cache_dtype``
    stores it: the engine's own ``KVCacheFormat``)."""
    import torch

    from ..layers.kv_quant import get_format
    return get_format(kv_cache_dtype).bytes_per_token(*smollm2_kv_geometry(), torch.float32)


def blocks_in_one_gib(kv_cache_dtype: str, block_size: int = 16) -> int:
    """Blocks a 1 GiB pool holds, sized by the engine's own ``CacheConfig``."""
    from ..core.config import CacheConfig
    return CacheConfig(block_size=block_size, kv_cache_bytes=2**30).num_blocks_for(
        smollm2_kv_bytes_per_token(kv_cache_dtype), 2048, 64)


def smollm2_all_reduce_bytes_per_token(tensor_parallel_size: int) -> float:
    """Bytes one rank sends per token in a ring all-reduce of every layer's two sums (fp32):
    ``traffic.tp_bytes_per_token`` on SmolLM2's own config."""
    from transformers import AutoConfig

    from ..engines.r10_tensor.traffic import tp_bytes_per_token
    from ..models import ensure_smollm2_cache
    c = AutoConfig.from_pretrained(ensure_smollm2_cache())
    return tp_bytes_per_token(c.hidden_size, c.num_hidden_layers, tensor_parallel_size)


def handoff_bytes(prompt_len: int, block_size: int = 16) -> int:
    """Bytes rung 11 moves for one prompt of ``prompt_len`` tokens on SmolLM2 (fp32): the blocks
    holding all but its last token, whole: ceil((prompt_len - 1) / block_size) of them."""
    return -(-(prompt_len - 1) // block_size) * block_size * smollm2_kv_bytes_per_token()


def smollm2_handoff_bytes(prompt_len: int, block_size: int = 16) -> int:
    """Bytes rung 11 moves from the prefill worker to the decode worker for one prompt of
    ``prompt_len`` tokens on SmolLM2 (fp32): the blocks holding all but its last token
    (``transfer.filled_blocks``), whole, at the engine's bytes per token."""
    from ..engines.r11_disagg.transfer import filled_blocks

    moved = filled_blocks(list(range(prompt_len)), prompt_len - 1, block_size)
    return len(moved) * block_size * smollm2_kv_bytes_per_token()


def blocks_by_definition(prompt_len: int = 64, out_len: int = 20, n: int = 3,
                         block_size: int = 16) -> tuple[int, int]:
    """``blocks_independent_vs_shared`` by the block manager's definition: each request alone
    holds ceil((prompt + output) / block_size) blocks; ``n`` samples share the prompt's full
    blocks, and each has its own blocks for the rest (its copy of a partly filled prompt block
    included)."""
    def cdiv(a: int) -> int:
        return -(-a // block_size)
    full = prompt_len // block_size
    return n * cdiv(prompt_len + out_len), full + n * (cdiv(prompt_len + out_len) - full)


def blocks_independent_vs_shared(prompt_len: int = 64, out_len: int = 20, n: int = 3,
                                 block_size: int = 16) -> tuple[int, int]:
    """Blocks held at the end by ``n`` independent requests vs one request with ``n`` samples,
    counted by running the block manager itself."""
    from ..core.block_manager import BlockManager
    from ..core.sequence import Sequence
    from ..request import Request, SamplingParams

    def used(bm: BlockManager) -> int:
        return bm.num_blocks - bm.num_free_blocks

    def grow(bm: BlockManager, seq: Sequence, k: int) -> None:
        seq.token_ids += [0] * k
        bm.append_slots(seq, k)
        seq.num_computed_tokens = seq.num_tokens

    req = Request([1] * prompt_len, SamplingParams())
    alone = BlockManager(1000, block_size)
    for _ in range(n):
        seq = Sequence(req, [1] * prompt_len, prompt_len)
        alone.append_slots(seq, prompt_len)
        seq.num_computed_tokens = prompt_len
        grow(alone, seq, out_len)
    shared = BlockManager(1000, block_size)
    first = Sequence(req, [1] * prompt_len, prompt_len)
    shared.append_slots(first, prompt_len)
    first.num_computed_tokens = prompt_len
    for seq in [first] + [shared.fork(first) for _ in range(n - 1)]:
        grow(shared, seq, out_len)
    return used(alone), used(shared)


def returned_by_definition(computed: int = 30, guesses: int = 8, accepted: int = 1,
                           block_size: int = 4) -> int:
    """``blocks_returned_after_rejection`` by the definition: the blocks for every verified
    position, minus the blocks for the positions kept."""
    def cdiv(a: int) -> int:
        return -(-a // block_size)
    return cdiv(computed + 1 + guesses) - cdiv(computed + 1 + accepted)


def blocks_returned_after_rejection(computed: int = 30, guesses: int = 8, accepted: int = 1,
                                    block_size: int = 4) -> int:
    """Blocks a sequence gives back when it verified ``guesses`` guesses after ``computed``
    computed tokens (plus its newest token) and ``accepted`` were kept, counted by running the
    block manager's own ``truncate``."""
    from ..core.block_manager import BlockManager
    from ..core.sequence import Sequence
    from ..request import Request, SamplingParams

    bm = BlockManager(1000, block_size)
    seq = Sequence(Request([1], SamplingParams()), [1] * (computed + 1 + guesses), computed + 1)
    bm.append_slots(seq, computed + 1 + guesses)     # the context and the verified positions
    seq.num_computed_tokens = seq.num_tokens
    held = len(seq.block_table)
    bm.truncate(seq, computed + 1 + accepted)        # kept: newest token + accepted guesses
    return held - len(seq.block_table)


def overtake_horizon_by_definition(max_tokens: int = 128, priority: int = 1) -> int:
    """``score_overtake_horizon`` from ``Score``'s default weights and the bound's formula (a
    request that has generated nothing has ``max_tokens`` remaining)."""
    from ..engines.r8_policies.policy import Score

    w = Score()
    head = w.priority_weight * priority + w.remaining_weight * max_tokens + w.margin
    return max(0, math.floor(head / w.wait_weight))


def score_overtake_horizon(max_tokens: int = 128, priority: int = 1) -> int:
    """Steps after a waiting ``priority``-1 request with ``max_tokens`` arrives during which a
    later priority-0 request can still rank ahead of it under ``score``'s default weights,
    computed by the policy's own ``overtake_horizon``."""
    from ..core.block_manager import BlockManager
    from ..engines.r8_policies.policy import Score
    from ..core.scheduler import Scheduler
    from ..request import Request, SamplingParams

    sched = Scheduler(BlockManager(8, 16), policy=Score())
    group = sched.add(Request([1], SamplingParams(max_tokens=max_tokens), priority=priority))
    return Score().overtake_horizon(group, min_priority=0)


def stage_layers_by_definition(num_layers: int = 30, world_size: int = 4) -> tuple[int, int]:
    """(layers on rank 0, layers on the last rank) when ``num_layers`` are cut into
    ``world_size`` stages: ``split_layers``' definition (as even as possible, the earlier ranks
    taking the extra ones), not a run of it (exercise 07 has students write it)."""
    base, extra = divmod(num_layers, world_size)
    return base + (extra > 0), base + (extra >= world_size)


def stage_layers(num_layers: int = 30, world_size: int = 4) -> tuple[int, int]:
    """The same from the package's ``split_layers`` (the tests compare the two)."""
    from ..engines.r7_pipeline.stage import split_layers
    bounds = split_layers(num_layers, world_size)
    return bounds[0][1] - bounds[0][0], bounds[-1][1] - bounds[-1][0]


def rslora_scale(lora_alpha: float = 32, r: int = 16) -> float:
    """The factor rung 13 folds into B for an rsLoRA adapter (``adapter.lora_scale``)."""
    from ..engines.r13_lora.adapter import lora_scale
    return lora_scale(lora_alpha, r, True)


def int8_projection_bytes() -> int:
    """Bytes of one SmolLM2 ``hidden x hidden`` projection stored as rung 14's ``int8`` stores it:
    the definition's arithmetic (a handout stubs ``quantize_per_channel``): one byte per weight
    and one fp32 scale per output row."""
    from transformers import AutoConfig

    from ..models import ensure_smollm2_cache
    hidden = AutoConfig.from_pretrained(ensure_smollm2_cache()).hidden_size
    return hidden * hidden + 4 * hidden


def in_handout() -> bool:
    """A students' copy (``lab handout``): it has no graders, and the key stays with the teacher."""
    from pathlib import Path
    return not (Path(__file__).parent / "graders").is_dir()


@dataclass(frozen=True)
class Question:
    id: str
    text: str
    compute: Callable[[], object]
    hint: str
    rel_tol: float = 0.01

    def truth(self) -> object:
        """The expected answer (the teacher's key); refused in a handout."""
        if in_handout():
            raise PermissionError("this copy is a handout: the key stays with the teacher "
                                  f"(check an answer with lab.check({self.id!r}, answer))")
        return self.compute()


QUESTIONS: dict[str, Question] = {q.id: q for q in [
    Question("00.q1", "KV memory, in bytes, of 32 concurrent requests of 2,048 tokens on SmolLM2 "
             "(fp32)", lambda: 32 * 2048 * smollm2_kv_bytes_per_token(),
             "model.kv_bytes_per_token is one token's K and V over all layers; answer in bytes",
             rel_tol=0.0),
    Question("01.q3a", "rows of 2,048 slots that fit in 1 GiB of KV memory on SmolLM2 (fp32)",
             lambda: 2**30 // (2048 * smollm2_kv_bytes_per_token()),
             "a row reserves 2,048 × kv_bytes_per_token bytes; 1 GiB = 2**30 bytes; whole rows "
             "only", rel_tol=0.0),
    Question("01.q3b", "fraction of those reserved slots that hold tokens when the average "
             "request uses 300 tokens", lambda: 300 / 2048,
             "tokens used / slots reserved per row, as a fraction between 0 and 1"),
    Question("03.q3", "(blocks held by 3 independent requests, blocks held by one request with "
             "n = 3) for a 64-token prompt, block_size 16, 20 output tokens per sample",
             blocks_by_definition,
             "a tuple of two integers; with n = 3 the prompt's 4 full blocks are stored once",
             rel_tol=0.0),
    Question("06.q1", "blocks given back to the pool when a sequence with 30 computed tokens and "
             "a newest one verifies 8 guesses (block_size 4) and only 1 guess is accepted",
             returned_by_definition,
             "the verification held slots for 30 + 1 + 8 tokens; afterwards the sequence keeps "
             "K/V for 30 + 1 + 1 positions (the target's own next token has none yet); count "
             "whole blocks of 4 before and after", rel_tol=0.0),
    Question("07.q1", "(layers on rank 0, layers on rank 3) when SmolLM2's 30 layers are cut "
             "into pipeline_parallel_size=4 stages", stage_layers_by_definition,
             "a tuple of two integers; as even as possible, the earlier ranks taking the extra "
             "layers", rel_tol=0.0),
    Question("08.q1", "under policy score with its default weights, for how many steps after a "
             "batch request (priority 1, max_tokens 128) arrives can a later interactive request "
             "(priority 0) still be served before it? (D of the starvation bound)",
             overtake_horizon_by_definition,
             "D = (priority_weight × (1 − 0) + remaining_weight × 128 + margin) / wait_weight, "
             "rounded down; the weights are Score's defaults (engines/r8_policies/policy.py)",
             rel_tol=0.0),
    Question("09.q1", "blocks of 16 tokens in a 1 GiB KV pool on SmolLM2 with "
             "kv_cache_dtype=\"int8\"", lambda: blocks_in_one_gib("int8"),
             "one token: 30 layers × (K and V) × 3 KV heads × (64 one-byte codes + one 4-byte "
             "fp32 scale); a block is 16 tokens; whole blocks only", rel_tol=0.0),
    Question("10.q1", "bytes one rank sends per token with tensor_parallel_size=3 on SmolLM2 "
             "(fp32, ring all-reduces)", lambda: smollm2_all_reduce_bytes_per_token(3),
             "two all-reduces per layer of a [tokens, hidden] tensor; a ring all-reduce sends "
             "2 (T - 1) / T of the tensor out of every rank; hidden 576, 30 layers, 4 bytes",
             rel_tol=1e-9),
    Question("11.q1", "bytes the disagg engine moves from the prefill worker to the decode "
             "worker for one 1000-token prompt on SmolLM2 (fp32 cache, block_size 16)",
             lambda: handoff_bytes(1000),
             "the prefill worker computes every prompt token but the last; the blocks holding "
             "them move whole (the last one partly filled); one token is 30 layers × (K and V) × "
             "3 KV heads × 64 × 4 bytes", rel_tol=0.0),
    Question("13.q1", "the scale an rsLoRA adapter with r = 16 and lora_alpha = 32 multiplies "
             "its delta B A x by", rslora_scale,
             "plain LoRA divides lora_alpha by r; rsLoRA (use_rslora) by the square root of r",
             rel_tol=1e-9),
    Question("14.q1", "bytes of one 576 x 576 projection of SmolLM2 with int8 weights and fp32 "
             "per-channel scales", int8_projection_bytes,
             "one byte per weight; one 4-byte scale per output channel (a row of W)",
             rel_tol=0.0),
]}


def _close(answer, truth, rel_tol: float) -> bool:
    if isinstance(truth, tuple):
        return (isinstance(answer, (tuple, list)) and len(answer) == len(truth)
                and all(_close(a, t, rel_tol) for a, t in zip(answer, truth)))
    if isinstance(truth, str):
        return isinstance(answer, str) and answer.strip().casefold() == truth.casefold()
    try:
        return math.isclose(float(answer), float(truth), rel_tol=rel_tol, abs_tol=1e-12)
    except (TypeError, ValueError):
        return False


def is_right(question_id: str, answer) -> bool:
    """Whether ``answer`` is right (exactly, for counts and byte sizes; within the question's
    tolerance for fractions)."""
    q = QUESTIONS.get(str(question_id))
    if q is None:
        raise KeyError(f"no question {question_id!r}: known ones are {', '.join(QUESTIONS)}")
    return _close(answer, q.compute(), q.rel_tol)


def check(question_id: str, answer) -> None:
    """Print whether ``answer`` is right, never the expected value. Returns nothing, so a
    notebook cell that ends with it shows the sentence only (``is_right`` returns the bool)."""
    q = QUESTIONS[str(question_id)] if str(question_id) in QUESTIONS else None
    ok = is_right(question_id, answer)
    print(f"✓ {q.id}: right." if ok else f"✗ {q.id}: not yet ({answer!r}). Hint: {q.hint}.")
