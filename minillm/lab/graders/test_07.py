"""Exercise 07 — pipeline stages: ``split_layers``, ``StageRunner.send_output`` and
``StageRunner.compute`` (``minillm/engines/r7_pipeline/stage.py``).

Graded in one process, no rank started: ``split_layers`` against its definition for every model
depth and world size up to a few dozen; then a pipeline of P stages (``StageRunner``s over the tiny
Llama, P = 1, 2, 3: three stages of two layers leave the last holding none) run inside one rung-3
engine, each micro-batch passed stage to stage through a recording ``comm``. Every message a stage
sends is checked against the protocol the ranks follow (hidden states ``[tokens, hidden]`` to the
next rank; the last stage's logits ``[rows to sample, vocab]`` back to rank 0, unless it is rank 0
or has no row to sample), every stage's output against what the next one (or the sampler) reads,
and the tokens of a workload that forks (n = 2 samples, beams: copy-on-write), preempts and
prefills in chunks (micro-batches with no row to sample) against the single-process engine's.

The runs happen in the student's process (``probe_*``, the ``student`` fixture) and send back
what happened, judged here.
"""
from __future__ import annotations

import pytest
import torch

from minillm.lab.reference import baseline, tiny_model

OUTSIDE = True       # judged in the grading process on values from the student's (grade.py)


# --- split_layers ------------------------------------------------------------------------------
def split_by_definition(num_layers: int, world_size: int) -> list[tuple[int, int]]:
    base, extra = divmod(num_layers, world_size)
    sizes = [base + (r < extra) for r in range(world_size)]
    return [(sum(sizes[:r]), sum(sizes[:r + 1])) for r in range(world_size)]


SPLITS = [(layers, world) for layers in range(0, 34) for world in range(1, 10)]


def probe_split(cases: list) -> list:
    from minillm.engines.r7_pipeline.stage import split_layers
    out = []
    for layers, world in cases:
        try:
            out.append([[int(a), int(b)] for a, b in split_layers(layers, world)])
        except NotImplementedError:
            raise
        except Exception as e:        # noqa: BLE001 - judged here, with the case
            out.append(f"{type(e).__name__}: {e}")
    return out


def split_mistake(layers: int, world: int, got) -> str:
    """What is wrong with ``got`` as ``split_layers(layers, world)``."""
    want = split_by_definition(layers, world)
    case = f"split_layers({layers}, {world})"
    if isinstance(got, str):
        return f"{case} raised {got} (want {want})"
    if [[s, e + 1] for s, e in got] == [list(b) for b in want]:
        return (f"{case} = {got}: the bounds are [start, end), end one past the slice's last "
                f"layer, so the next rank starts where this one ends (want {want})")
    if len(got) != world:
        return f"{case} gave {len(got)} slices for {world} ranks: one [start, end) per rank: {got}"
    if any(e < s for s, e in got):
        return f"{case} = {got}: a slice [start, end) has end >= start"
    if got[0][0] != 0 or any(got[r][1] != got[r + 1][0] for r in range(world - 1)):
        if all(got[r][1] + 1 == got[r + 1][0] for r in range(world - 1)):
            return (f"{case} = {got}: the bounds are [start, end), end one past the slice's last "
                    f"layer, so the next rank starts where this one ends (want {want})")
        return f"{case} = {got}: the slices must follow each other from layer 0 (want {want})"
    if got[-1][1] < layers:
        return (f"{case} = {got}: layers {got[-1][1]}..{layers - 1} are on no rank (an uneven "
                f"split loses the remainder: divmod gives the extra layers to the first ranks; "
                f"want {want})")
    if got[-1][1] > layers:
        return (f"{case} = {got}: the slices end at layer {got[-1][1]}, past the model's "
                f"{layers} layers (rounding each slice up overshoots; want {want})")
    sizes = [e - s for s, e in got]
    if max(sizes) - min(sizes) > 1:
        return (f"{case} = {got}: slice sizes {sizes} differ by more than one: as even as "
                f"possible (want {want})")
    return (f"{case} = {got}: the earlier ranks take the extra layers (rank 0 also embeds, the "
            f"last also applies the head: kv_bytes_per_rank and the notebook count on it; want "
            f"{want})")


def test_split_layers_covers_every_layer_once_as_evenly_as_possible(student):
    got = student.run(probe_split, SPLITS)
    for (layers, world), mine in zip(SPLITS, got):
        want = [list(b) for b in split_by_definition(layers, world)]
        assert mine == want, split_mistake(layers, world, mine)


# --- a pipeline in one process ------------------------------------------------------------------
class ProtocolError(Exception):
    """A stage broke what the ranks expect of each other (said in the message)."""


def one_process_pipeline(world: int, opts: dict):
    """Rung 3's engine whose forward is ``world`` stages, run one after the other here: the
    micro-batch's inputs from stage 0's ``prepare_step``, each stage's ``compute``, and what its
    ``send_output`` sends, recorded, routed to the next stage (or back to rank 0)."""
    from minillm.core.engine import PagedEngine
    from minillm.core.model import PagedLlama
    from minillm.engines import engine_kwargs
    from minillm.engines.r7_pipeline.stage import StageConfig, StageRunner

    class Comm:
        def __init__(self, rank: int):
            self.rank, self.world_size, self.sent = rank, world, []

        def isend(self, tensor, dst):
            self.sent.append((int(dst), tensor))

        def send(self, tensor, dst):
            self.isend(tensor, dst)

    class OneProcessPipeline(PagedEngine):
        name = "pipeline-in-one-process"

        def make_runner(self, num_blocks, block_size, backend):
            config = StageConfig(world, num_blocks, block_size, self.model_config.attention_backend,
                                 self.cache_config.kv_cache_dtype)
            net = PagedLlama(self.model.hf_model, self.linear_kernel(), self.layer_ops())
            self.stages = [StageRunner(net, r, config, backend, self.model.device,
                                       self.model.dtype) for r in range(world)]
            self.microbatches = 0
            return self.stages[0]

        def execute(self, sched):
            index = self.microbatches
            self.microbatches += 1
            ids, inputs, reached = self.stages[0].prepare_step(sched.scheduled, sched.copies,
                                                               index)
            rows, hidden = len(inputs.logit_rows), self.stages[0].hidden_size
            vocab = self.stages[0].net.vocab_size
            where = (f"micro-batch {index} ({inputs.num_tokens} tokens, {rows} rows to sample, "
                     f"{world} stage{'s' * (world > 1)})")
            x, logits = ids, None
            for r, stage in enumerate(self.stages):
                last = r == world - 1
                try:
                    out = stage.compute(inputs, x)
                except NotImplementedError:
                    raise
                except Exception as e:      # noqa: BLE001 - said with the micro-batch
                    raise ProtocolError(
                        f"{where}: stage {r}'s compute raised {type(e).__name__}: {e}"
                        + (" (the last stage with no row to sample returns a [0, vocab] float32 "
                           "tensor)" if last and rows == 0 else "")) from None
                if not last and tuple(out.shape) != (inputs.num_tokens, hidden):
                    raise ProtocolError(
                        f"{where}: stage {r} of {world} is not the last, so compute returns its "
                        f"hidden states [tokens, hidden] = [{inputs.num_tokens}, {hidden}], got "
                        f"{list(out.shape)}")
                if last and (tuple(out.shape) != (rows, vocab)
                             or out.dtype != torch.float32):
                    raise ProtocolError(
                        f"{where}: the last stage's compute returns the logits of "
                        f"inputs.logit_rows only, [rows to sample, vocab] = [{rows}, "
                        f"{vocab}] float32 (the final norm, then the head, on "
                        f"those rows; [0, vocab] when there are none), got {list(out.shape)} "
                        f"{out.dtype}")
                comm = Comm(r)
                stage.send_output(comm, out)
                sent = [(dst, list(t.shape)) for dst, t in comm.sent]
                if not last:
                    if sent != [(r + 1, [inputs.num_tokens, hidden])]:
                        raise ProtocolError(
                            f"{where}: stage {r} sent {sent or 'nothing'} (destination, shape); "
                            f"a stage that is not the last sends its hidden states once, to the "
                            f"next rank: [({r + 1}, {[inputs.num_tokens, hidden]})]")
                    x = comm.sent[0][1]
                    continue
                if r == 0:
                    if sent:
                        raise ProtocolError(
                            f"{where}: with one stage, rank 0 computes the logits itself and "
                            f"sends nothing (it would be waiting for its own message), sent {sent}")
                    logits = out
                elif any(dst != 0 for dst, _ in sent):
                    raise ProtocolError(
                        f"{where}: the last stage (rank {r}) sent {sent} (destination, shape): "
                        f"there is no rank after it; it sends its logits back to rank 0, which "
                        f"samples")
                elif rows == 0:
                    if sent:
                        raise ProtocolError(
                            f"{where}: the last stage sent {sent} for a micro-batch with no row "
                            f"to sample (a prompt chunk that does not reach the prompt's end): "
                            f"rank 0 receives logits only when there are rows to sample, so this "
                            f"message would be read as the next micro-batch's logits: send "
                            f"nothing then")
                    logits = out
                else:
                    if sent != [(0, [rows, vocab])]:
                        raise ProtocolError(
                            f"{where}: the last stage (rank {r}) sent {sent or 'nothing'} "
                            f"(destination, shape); it sends its logits back to rank 0, which "
                            f"samples: [(0, {[rows, vocab]})]")
                    logits = comm.sent[0][1]
            return reached, logits

    return OneProcessPipeline(tiny_model(), **engine_kwargs(opts))


def workload():
    """Greedy and seeded requests, n = 2 samples and a beam search (they fork: copy-on-write),
    prompts of 5 to 37 tokens (chunked by a small budget: micro-batches with nothing to sample)."""
    from minillm import Request, SamplingParams
    reqs = []
    for i in range(7):
        if i == 3:
            params = SamplingParams(max_tokens=6, beam_width=2)
        else:
            params = SamplingParams(max_tokens=6 + i, temperature=0.8 if i % 2 else 0.0,
                                    seed=i, n=2 if i in (1, 4) else 1, ignore_eos=True)
        prompt = [(11 * i + 5 * k) % 300 + 3 for k in range(5 + 5 * i + (i == 0) * 32)]
        reqs.append(Request(prompt, params, request_id=f"r{i}"))
    return reqs


KINDS = {"r0": "greedy, a 37-token prompt", "r1": "n = 2 seeded samples (they fork: "
         "copy-on-write)", "r2": "greedy", "r3": "beam search, 2 beams (forks: copy-on-write)",
         "r4": "n = 2 samples (copy-on-write)", "r5": "seeded sampling", "r6": "greedy"}


def probe_serve(world: int | None, opts: dict) -> dict:
    """``workload()`` through ``world`` stages in one process (None: the plain paged engine)."""
    from minillm.core.engine import PagedEngine
    from minillm.engines import engine_kwargs
    if world is None:
        engine = PagedEngine(tiny_model(), **engine_kwargs(opts))
    else:
        engine = one_process_pipeline(world, opts)
    reqs = workload()
    for r in reqs:
        engine.add_request(r)
    raised = None
    try:
        for _ in range(2000):
            if not engine.has_unfinished():
                break
            engine.step()
    except NotImplementedError:
        raise
    except ProtocolError as e:
        raised = str(e)
    except Exception as e:          # noqa: BLE001 - judged here
        raised = f"your stages raised {type(e).__name__}: {e}"
    bm = engine.block_manager
    out = {"raised": raised,
           "tokens": {r.request_id: [[int(t) for t in s] for s in r.samples] for r in reqs},
           "preemptions": int(engine.num_preemptions), "full": bm.num_free_blocks == bm.num_blocks}
    if world is not None:
        out["layers"] = [[s.start, s.end] for s in engine.stages]
        out["microbatches"] = engine.microbatches
    return out


OPTIONS = {
    "roomy": dict(num_blocks=128, block_size=4, max_num_seqs=8, max_num_batched_tokens=16,
                  attention_backend="torch"),
    "tight": dict(num_blocks=20, block_size=4, max_num_seqs=4, max_num_batched_tokens=12,
                  attention_backend="torch"),
}
CASES = [(world, name) for world in (2, 3, 1) for name in OPTIONS]


@pytest.mark.parametrize("world, name", CASES, ids=[f"{w}-stages-{n}" for w, n in CASES])
def test_stages_in_one_process_give_the_single_process_tokens(student, world, name):
    opts = OPTIONS[name]
    got = student.run(probe_serve, world, opts)
    assert got["raised"] is None, got["raised"]
    want = baseline(student, probe_serve, None, opts)
    layers = [list(b) for b in split_by_definition(2, world)]
    assert got["layers"] == layers, (
        f"the {world} stages hold layers {got['layers']} of the tiny model's 2, want {layers} "
        "(StageRunner takes its slice from split_layers)")
    for rid, tokens in want["tokens"].items():
        assert got["tokens"][rid] == tokens, (
            f"{world} stages, {name} pool: request {rid} ({KINDS[rid]}) differs from the single-"
            f"process engine's tokens"
            + (": its samples share blocks until one writes; compute does the micro-batch's "
               "copy-on-write copies (inputs.copies, self.copy_blocks) on this stage's pool "
               "before its layers" if "copy-on-write" in KINDS[rid] else
               ": are the logits those of inputs.logit_rows, after the final norm?")
            + f"\ngot  {got['tokens'][rid]}\nwant {tokens}")
    if name == "tight":
        assert want["preemptions"] > 0, "the tight pool was meant to preempt"
    assert got["preemptions"] == want["preemptions"]
    assert got["full"], "blocks leaked: the pool is not full again after every request"
