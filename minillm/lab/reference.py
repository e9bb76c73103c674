"""The ground truth every engine, and every student's exercise, is checked against: Hugging Face
``generate`` run on each request alone, greedy. Used by the tests and by the lab's graders."""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch


@dataclass
class Reference:
    tokens: list[int]
    margins: list[float]   # top-1 minus top-2 logit at each generated position


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, stop_at_eos: bool = False) -> Reference:
    """HF ``generate`` on one request alone (no padding): the ground truth."""
    ids = torch.tensor([prompt_ids])
    out = model.hf_model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
        min_new_tokens=0 if stop_at_eos else max_new_tokens, pad_token_id=model.pad_token_id,
        output_scores=True, return_dict_in_generate=True)
    tokens = out.sequences[0, ids.shape[1]:].tolist()
    margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
    return Reference(tokens, margins)


def assert_greedy_match(got: list[int], ref: Reference, tie_tol: float = 1e-3, label: str = ""):
    """Token for token equal — or, if batching changed a token, it happened at a near-tie.

    fp32 results depend on batch shape in the last bits; when HF's top two logits are within
    ``tie_tol`` the argmax may legitimately flip, and everything after it differs. We allow that
    only at a demonstrated near-tie, and say so, never silently."""
    if got == ref.tokens:
        return
    first = next((i for i, (a, b) in enumerate(zip(got, ref.tokens)) if a != b), min(len(got), len(ref.tokens)))
    assert first < len(ref.margins) and ref.margins[first] < tie_tol, (
        f"{label}: diverged from HF generate at token {first} where HF's top-2 margin is "
        f"{ref.margins[first] if first < len(ref.margins) else 'n/a'} (not a near-tie)\n"
        f"got {got}\nref {ref.tokens}")
    print(f"{label}: diverged at a near-tie (token {first}, margin {ref.margins[first]:.2e})")


_TINY: dict = {}


def tiny_model():
    """The tiny Llama (fp32), loaded once per process: graders call it in the grading process and
    the student's process alike (each loads its own)."""
    if "m" not in _TINY:
        from ..models import load_model
        _TINY["m"] = load_model("tiny-llama", dtype=torch.float32)
    return _TINY["m"]


def random_prompts(n: int, seed: int = 0, lo: int = 1, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


KINDS = ["n = 3 sampling", "beam search (2 beams)", "greedy", "n = 2 sampling"]


def pressure_runs(kv_cache_dtype: str = "auto", tight: bool = True) -> tuple:
    """n = 3 and n = 2 seeded sampling, beam search and a greedy request, run in a roomy pool and
    (``tight``) in a pool tight enough to fork, copy on write, hit the prefix cache and preempt;
    float64, so that the batch's shape cannot flip a token. Returns plain data (a grader gets it
    from the student's process): (roomy samples, tight samples, preemptions, leaks), the samples
    one list of token lists per request, leaks the runs whose pool did not end full."""
    from .. import LLM, SamplingParams, load_model

    model = load_model("tiny-llama", dtype=torch.float64)
    prefix = [7, 8, 9, 10, 11, 12, 13, 14]          # two full blocks shared by every prompt
    prompts = [prefix + p for p in random_prompts(4, seed=61, lo=1, hi=5)]
    params = [SamplingParams(max_tokens=10, n=3, temperature=0.9, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=8, beam_width=2, ignore_eos=True),
              SamplingParams(max_tokens=10, ignore_eos=True),
              SamplingParams(max_tokens=9, n=2, temperature=0.7, seed=3, ignore_eos=True)]
    leaks: list[str] = []

    def run(name, **pool):
        llm = LLM(model, engine="paged", block_size=4, attention_backend="torch",
                  kv_cache_dtype=kv_cache_dtype, **pool)
        outs = llm.run(llm.make_requests(prompts, params)).outputs
        errors = [o.error for o in outs if o.error is not None]
        if errors:
            raise RuntimeError(f"{name} pool: {errors}")
        if llm.engine.block_manager.num_free_blocks != llm.engine.block_manager.num_blocks:
            leaks.append(name)
        return [[[int(t) for t in s] for s in o.samples] for o in outs], llm.engine.num_preemptions

    roomy, _ = run("roomy", num_blocks=400)
    if not tight:
        return roomy, None, 0, leaks
    squeezed, preemptions = run("tight", num_blocks=18, max_num_seqs=4, max_num_batched_tokens=8,
                                enable_prefix_caching=True)
    return roomy, squeezed, int(preemptions), leaks


_ROOMY: dict[str, list] = {}


def judge_pressure(result: tuple, functions: str, kv_cache_dtype: str = "auto") -> None:
    """Judge ``pressure_runs``' result (from the student's process): the tight pool must give
    exactly what the roomy pool gives, and the roomy pool what the package's own code gives.
    ``functions``: what to look at when they differ (named in the message)."""
    roomy, tight, preemptions, leaks = result
    assert not leaks, f"blocks leaked ({leaks}): the pool is not full again after every request"
    assert preemptions > 0, "the tight pool was meant to preempt"
    for kind, got, want in zip(KINDS, tight, roomy, strict=True):
        assert got == want, (
            f"{kind}: a tight pool (forks, copy-on-write, prefix hits, preemption) gave other "
            f"tokens than a roomy pool: look at {functions}\ngot  {got}\nwant {want}")
    if kv_cache_dtype not in _ROOMY:        # the package's own run, once per grading process
        _ROOMY[kv_cache_dtype] = package_reference(pressure_runs, kv_cache_dtype, tight=False)
    want = _ROOMY[kv_cache_dtype]
    assert want is None or roomy == want[0], (
        f"a roomy pool gave other tokens than the package's own code: look at {functions}")


def package_reference(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` computed with the package's own code in the grading process, or
    None where this copy of the package has no reference for it: in a handout the exercised
    functions are stubs (``NotImplementedError``), so a student's own check there compares the
    student's results with each other and with Hugging Face only; the teacher's grading, in the
    full repository, also compares them with the package's."""
    try:
        return fn(*args, **kwargs)
    except NotImplementedError:
        return None


def baseline(student, probe, *args, **kwargs):
    """``probe(*args, **kwargs)`` — a run that needs none of the exercised functions (plain
    decoding, FCFS) — by the package's own code here; in a handout, where the engine's modules
    are stubs, in the student's process instead, with the student's solutions of those
    exercises standing in (a self-check there is then relative; the teacher's grading, in the
    full repository, is not)."""
    try:
        return probe(*args, **kwargs)
    except NotImplementedError:
        return student.run(probe, *args, **kwargs)



def mixed_requests(seed: int = 0) -> list:
    """Ten requests that exercise a whole step: a shared 8-token prefix (prefix caching),
    greedy and seeded sampled rows, n = 3 samples and a beam search, prompts of 10-37 tokens.
    Rung 12's tests and its exercise grader (tests/rungs/test_r12_async_scheduling.py,
    graders/test_12_async.py) run it through the synchronous and the overlapped engine."""
    from ..request import Request, SamplingParams

    shared = [11, 12, 13, 14, 15, 16, 17, 18]
    reqs = []
    for i in range(10):
        if i == 3:
            params = SamplingParams(max_tokens=8, beam_width=3)
        else:
            params = SamplingParams(max_tokens=12 + i, temperature=0.9 if i % 2 else 0.0,
                                    seed=seed + i, n=3 if i % 4 == 0 else 1, top_k=20)
        prompt = shared + [(7 * i + k) % 200 + 3 for k in range(2 + 3 * i)]
        reqs.append(Request(prompt, params, request_id=f"r{i}"))
    return reqs


# Rung 13's exercises (graders/test_13.py, test_13_slots.py): adapters made in memory, never
# read from disk (the student's process may see no folder of the teacher's). name -> (rank,
# projections, rsLoRA): different ranks, modules and scalings (lora_alpha = 2 r).
LORAS = {"qv": (2, ("q_proj", "v_proj"), False),
         "mlp": (8, ("gate_proj", "up_proj", "down_proj"), False),
         "all": (4, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                 True)}


def lora_adapters(hf_model, std: float = 0.5) -> dict:
    """name -> ``LoRAAdapter`` for each of ``LORAS``, seeded (the same in every process), sized
    as ``peft_files.save_random_adapter`` sizes them (enough to change the tokens)."""
    import math

    from ..engines.r13_lora.adapter import LoRAAdapter, lora_scale
    from ..engines.r13_lora.peft_files import hf_shapes, module_key

    shapes, dtype = hf_shapes(hf_model), next(hf_model.parameters()).dtype
    out = {}
    for seed, (name, (r, targets, rslora)) in enumerate(LORAS.items()):
        g = torch.Generator().manual_seed(100 + seed)
        scale = lora_scale(2 * r, r, rslora)
        weights = {}
        for layer in range(hf_model.config.num_hidden_layers):
            for m in targets:
                n_out, n_in = shapes[m]
                w = hf_model.get_submodule(module_key(layer, m)).weight.detach().float()
                a = torch.randn(r, n_in, generator=g) / math.sqrt(n_in)
                b = torch.randn(n_out, r, generator=g) * (std * w.std().item()
                                                          * math.sqrt(n_in / r) / scale)
                weights[layer, m] = (a.to(dtype), b.to(dtype))
        out[name] = LoRAAdapter(name, r, scale, weights)
    return out


def serve_loras(model, names: list, prompts: list[list[int]], max_tokens: int,
                **options) -> dict:
    """Greedy ``prompts`` through the multi-LoRA engine, prompt i under adapter ``names[i]``
    (None: the base model), the adapters of ``lora_adapters`` handed to the engine as if read
    (``engine.adapters``). Plain data: each request's tokens and error, the slots' loads and
    evictions, and whether the pool ended full."""
    from .. import LLM, LoRARequest, SamplingParams

    llm = LLM(model, engine="paged", enable_lora=True, max_lora_rank=8, **options)
    engine = llm.engine
    loras = {}
    for name, adapter in lora_adapters(model.hf_model).items():
        loras[name] = LoRARequest(name, f"in-memory/{name}")
        engine.adapters[name] = (loras[name], adapter)
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                        lora_request=[None if n is None else loras[n] for n in names])
    bm, slots = engine.block_manager, engine.runner.slots
    return {"tokens": [[int(t) for t in o.token_ids] for o in outs],
            "errors": [None if o.error is None else str(o.error) for o in outs],
            "loads": int(slots.loads), "evictions": int(slots.evictions),
            "full": bm.num_free_blocks == bm.num_blocks}


def merged_references(model, names: list, prompts: list[list[int]], max_tokens: int) -> list:
    """Hugging Face ``generate`` on each prompt alone, with its adapter merged into a copy of
    the model's weights (``W + scale B A``): what ``serve_loras`` must give."""
    import dataclasses

    from ..engines.r13_lora.peft_files import merged_model

    adapters, merged = lora_adapters(model.hf_model), {}
    refs = []
    for name, prompt in zip(names, prompts):
        if name is not None and name not in merged:
            merged[name] = dataclasses.replace(
                model, hf_model=merged_model(model.hf_model, adapters[name]))
        refs.append(hf_greedy(model if name is None else merged[name], prompt, max_tokens))
    return refs
