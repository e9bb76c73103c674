"""The exercises: for each rung, which functions of the engine a student writes, and who grades them.

An exercise names a module of the package and the functions (or methods, ``Class.method``) whose
bodies a student writes. ``start`` copies that module with those bodies replaced by a
``NotImplementedError``; ``check`` runs the exercise's grader (``graders/test_<id>.py``) with the
student's file standing in for the package's module, so the real engine runs the student's code.
The package's own code is the reference solution: graded without a student file, it must pass.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Exercise:
    id: str
    title: str
    module: str               # dotted name of the module the student rewrites
    functions: tuple[str, ...]
    notebook: str             # where the idea is taught
    minutes: int              # what a student needs, roughly (the teacher's guide plans with it)
    hint: str

    @property
    def file_name(self) -> str:
        return self.module.rpartition(".")[2] + ".py"

    @property
    def source_path(self) -> Path:
        return Path(importlib.util.find_spec(self.module).origin)

    @property
    def grader(self) -> Path:
        return Path(__file__).parent / "graders" / f"test_{self.id.replace('-', '_')}.py"


EXERCISES: dict[str, Exercise] = {e.id: e for e in [
    Exercise("01", "Static batching: left padding, the mask and the positions",
             "minillm.engines.padded", ("left_pad", "hf_forward"), "01_static_batching", 25,
             "Pad on the left so every row's newest token is in the last column; the mask is 1 "
             "on real tokens; a row's positions count its real tokens only."),
    Exercise("02", "Dynamic batching: requests join and leave the running batch",
             "minillm.engines.r2_dynamic", ("DynamicBatchEngine._admit", "DynamicBatchEngine._compact"),
             "02_dynamic_batching", 35,
             "Newcomers are prefilled together, then take the holes first and new rows after; "
             "compaction drops the holes from the rows *and* from the KV rectangle."),
    Exercise("03", "The block manager: append, fork, free and copy-on-write",
             "minillm.core.block_manager",
             ("BlockManager.blocks_needed", "BlockManager._needs_cow", "BlockManager.append_slots",
              "BlockManager.fork", "BlockManager.free", "BlockManager._release"),
             "03_block_manager", 40,
             "A block's ref_count is the number of sequences listing it; a block goes back to "
             "the free queue when its count reaches 0; writing into a block someone else holds "
             "copies it first."),
    Exercise("03-scheduler", "The scheduler: token budget, admission and preemption",
             "minillm.core.scheduler",
             ("Scheduler._schedule_running", "Scheduler._schedule_waiting", "Scheduler.preempt"),
             "03_block_manager", 45,
             "Running requests first, then waiting ones, while the budget, max_num_seqs and free "
             "blocks last (and at most max_new new ones); when a running sequence cannot get a "
             "block, preempt the lowest-ranked running request not in exclude "
             "(self._lowest_ranked(exclude)): free all its blocks and put it back at the front "
             "of the queue. A waiting group with no seat, or whose plan (self._plan) is empty, "
             "may evict a running one if the policy lets it (self._preempt_for): then try again. "
             "One that admit(group) refuses is passed over, not waited for."),
    Exercise("04", "Paged attention: write K/V into slots, read them back through block tables",
             "minillm.layers.attention.reference",
             ("TorchAttention.write_kv", "TorchAttention.gather", "TorchAttention.decode"),
             "04_triton_kernels", 30,
             "Token i of a sequence lives in block block_table[i // block_size] at offset "
             "i % block_size; decode attends to the first context_lens[b] tokens only."),
    Exercise("06", "Speculative decoding: which guesses the target keeps",
             "minillm.engines.r6_speculative.rejection",
             ("accept_greedy", "accept_seeded", "accept_sampled"), "06_speculative_decoding", 40,
             "Greedy: keep guesses while they equal the target's argmax, then add the target's "
             "own token. Seeded: the same, with the argmax replaced by plain decoding's draw at "
             "that output index (sample_one with draw_uniform(seed, index)). Unseeded: keep guess "
             "d with probability min(1, p(d) / q(d)); on the first rejection draw from "
             "max(0, p - q) renormalized, and stop."),
    Exercise("07", "Pipeline stages: who holds which layers, and what a stage sends",
             "minillm.engines.r7_pipeline.stage",
             ("split_layers", "StageRunner.send_output", "StageRunner.compute"),
             "07_pipeline_parallel", 35,
             "split_layers: P contiguous [start, end) slices covering every layer once, sizes "
             "differing by at most one, the earlier ranks taking the extra ones (divmod). "
             "send_output: a stage that is not the last sends its hidden states to the next "
             "rank (comm.isend(out, comm.rank + 1)); the last sends its logits back to rank 0, "
             "unless it is rank 0 itself or there are no rows to sample (rank 0 receives "
             "nothing then). compute: do the micro-batch's copy-on-write copies on this stage's "
             "pool, run its layers (self.forward embeds on the first stage); a stage that does "
             "not compute the logits returns the hidden states; the one that does returns the "
             "logits of inputs.logit_rows only (final norm, then the head), a [0, vocab] "
             "float32 tensor when there are none."),
    Exercise("08", "Scheduling policies: who goes first, and who may evict whom",
             "minillm.engines.r8_policies.policy",
             ("Priority.key", "Priority.preempts", "remaining_tokens", "Score.score",
              "Score.preempts"), "08_scheduling_policies", 35,
             "Priority: lower priority value first, ties by arrival_index; a waiting candidate "
             "evicts a running victim only if the victim's value is higher by MORE than the "
             "threshold. Score: priority_weight * priority + remaining_weight * remaining + "
             "wait_weight * arrival_step (lower first, ties by arrival_index), remaining being "
             "max_tokens minus what the furthest sample generated; evict only if the victim's "
             "score exceeds the candidate's by more than the margin."),
    Exercise("09", "A quantized KV cache: quantize on write, widen on read",
             "minillm.layers.kv_quant",
             ("quantize", "dequantize", "QuantizedPool.index_copy_",
              "QuantizedPool.index_select", "QuantizedPool.__getitem__"), "09_quantized_kv", 30,
             "One fp32 scale per row (token and KV head): max|x| / fmt.qmax, 1 for an all-zero "
             "row; int8 codes are round(x / scale) clamped to ±qmax, fp8 is (x / scale) cast to "
             "fmt.storage; a format without qmax is a plain cast with no scale. The pool writes "
             "quantized rows and their scales at the same slots (float8 has no index_copy_ on "
             "the CPU: copy it as uint8) and reads widen only the rows asked for."),
    Exercise("10", "Tensor parallelism: the column/row split and where the all-reduce goes",
             "minillm.engines.r10_tensor.shard",
             ("head_split", "shard_layer", "RowParallelLinear.__call__"), "10_tensor_parallel", 35,
             "Rank r computes query heads [r*H/T, (r+1)*H/T) and the KV heads they read (KVH/T of "
             "them, or, when T is a multiple of KVH, KV head r // (T/KVH)). Raise ValueError "
             "when the split cannot be made: T < 1, a rank outside 0 <= r < T, T not dividing "
             "H, or neither of T and KVH dividing the other. qkv keeps its q rows, then its KV "
             "heads' k rows and v rows (and the same bias rows); gate_up its intermediate units "
             "of gate and of up; o and down keep the matching input columns. A row-parallel call "
             "multiplies its slice, adds the residual on rank 0 only, then returns the all-reduce "
             "of that."),
    Exercise("11", "Disaggregation: the KV hand-off between the prefill and the decode worker",
             "minillm.engines.r11_disagg.transfer",
             ("filled_blocks", "Handoff.nbytes", "recv_blocks", "install_blocks"),
             "11_disaggregation", 30,
             "The first ceil(num_tokens / block_size) blocks of the table move, the last maybe "
             "partly filled; a hand-off's bytes are, for every pool tensor, its blocks times the "
             "elements of one block times the element size; the receiver reads each tensor as "
             "exactly that many uint8 bytes and views them as (blocks, *block shape) of the "
             "tensor's dtype; install_blocks = allocate_loaded, write_blocks, cache_full_blocks, "
             "or None with nothing allocated when the pool has no room."),
    Exercise("12", "The adaptive batch: a controller that holds a TPOT target",
             "minillm.engines.r12_realtime.batch_controller",
             ("TPOTController.observe", "TPOTController._fit", "TPOTController._cap"),
             "12_realtime_scheduling", 35,
             "Fold each step into exponentially weighted moments E[n], E[t], E[n²], E[nt] (weight "
             "alpha on the newest; the first step is taken as it is). The fit is least squares, "
             "b = (E[nt] - E[n]E[t]) / (E[n²] - E[n]²), a = E[t] - b E[n]; when the sizes have "
             "no spread (variance <= 1) or the fit gives b <= 0 or a < 0, keep the last fit's a "
             "if it is below E[t] (else a = 0) and b = (E[t] - a) / E[n]. The cap is "
             "floor((headroom * target - a) / b), within [1, ceiling]. "
             "Narrow at once; widen only by more than max(1, cap // 50) tokens; return a "
             "BatchDecision exactly when the cap moved (a step of no tokens, or a time that is "
             "negative or not finite, is ignored)."),
    Exercise("12-async", "The overlapped step: the forward on a worker thread, one step ahead",
             "minillm.engines.r12_realtime.engine",
             ("ThreadExecutor.submit", "ThreadExecutor.wait", "ThreadExecutor.call"),
             "12_realtime_scheduling", 30,
             "The core's loop (PagedEngine._step) lands the step in flight, then launches the "
             "next one ahead; your executor runs its forward. submit(fn, *args): let the caller's "
             "idle OpenMP threads go (release_idle_openmp_threads), then run fn on self.worker "
             "with the caller's torch thread count (_on_worker) and return the Future at once. "
             "wait(future): its (result, forward ms); add the forward to self.overlap (steps, "
             "forward_ms, and the ms this call blocked as waited_ms). call(fn, *args): run fn on "
             "the worker too and return its result (one OpenMP team); on Ctrl-C let it end "
             "first, then re-raise."),
    Exercise("13", "Multi-LoRA: each row's delta from its own adapter (the gather matmuls)",
             "minillm.engines.r13_lora.kernels", ("sgmv", "bgmv"), "13_multi_lora", 25,
             "A and B stack every slot's weights: A [slots, rank, in], B [slots, out, rank] (the "
             "scale already folded into B); the indices you are given are rows of those stacks. "
             "Row t's delta is B[s] @ (A[s] @ x[t]): shrink to the rank first, then expand. "
             "Add it into y in place at row t (y is a view of the layer's output columns: what "
             "you return is ignored), and touch no row you were not given. sgmv: for each "
             "(slot, rows), one matmul pair over those rows together; bgmv: every row gathers "
             "its own slot's A and B (A[idx]) and torch.bmm does them all, BGMV_CHUNK rows at a "
             "time."),
    Exercise("13-slots", "Multi-LoRA: adapter slots, swapped in least recently used first",
             "minillm.engines.r13_lora.slots", ("LoRASlots.acquire", "LoRASlots._write"),
             "13_multi_lora", 30,
             "self.lru maps each resident adapter to its slot, least recently used first. "
             "acquire: a resident adapter keeps its slot; else take the lowest free slot (names "
             "[s] is None), else the least recently used adapter not in busy is evicted (count "
             "it in self.evictions), else None (the request waits). The adapter acquired "
             "becomes the most recently used. _write: slot s is row s - 1 of every stacked A "
             "and B; clear the whole row first (a smaller rank, or fewer modules, than the "
             "adapter before must leave zeros), then A[:r] = a and B[:, :r] = adapter.scale * b "
             "for each (layer, module) it adapts; live[m] holds exactly the slots adapting m; "
             "names[s] and self.loads follow."),
    Exercise("14", "int8 weights: one scale per output channel",
             "minillm.layers.quant", ("quantize_per_channel", "Int8Linear.__call__"),
             "14_compiled", 30,
             "Each output channel (a row of W) gets its own fp32 scale, s = max|W_row| / 127 "
             "(computed on W.float()), and an all-zero row gets scale 1; the row is stored as "
             "q = round(W / s) clamped to [-127, 127], as torch.int8: return (q [out, in], "
             "s [out]). The product y = (x @ q.T) * s: s multiplies y's output columns, after "
             "the sum; then + bias, then residual + y. On the 'dequant' path widen q to x's "
             "dtype (q.to(x.dtype)) and let F.linear multiply; on 'int8pack' (self.path, or "
             "int8_path(x.device, x.dtype, rows) when it is None; fp32, bf16 or fp16 x only) call "
             "torch.ops.aten._weight_int8pack_mm(x2d, q, s) on x flattened to 2-D and give the "
             "result x's leading dimensions back."),
    Exercise("14-buckets", "A compiled step: the bucket a batch is padded to",
             "minillm.engines.r14_compiled.config", ("bucket_for", "parse_buckets"),
             "14_compiled", 15,
             "bucket_for(n, buckets): the smallest bucket >= n (a bucket equal to the batch holds "
             "it; never a smaller one: the padded step must hold every row), None when n is "
             "larger than every bucket (that step runs eagerly); n < 1 is a ValueError. "
             "parse_buckets('1,2,4,8') -> (1, 2, 4, 8), a tuple: items separated by commas (or "
             "semicolons), spaces around them allowed; None gives DEFAULT_BUCKETS; every item a "
             "positive integer, each larger than the one before, else a ValueError whose message "
             "names compile_buckets (the option the user set) and what is wrong with it."),
]}


def get(exercise_id: str) -> Exercise:
    key = str(exercise_id).strip()
    if key not in EXERCISES:
        raise SystemExit(f"no exercise {exercise_id!r}: choose one of {', '.join(EXERCISES)} "
                         "(python -m minillm.lab list)")
    return EXERCISES[key]
