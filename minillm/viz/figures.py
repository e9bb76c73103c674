"""``python -m minillm.viz.figures`` (``make figures``): every notebook's key figure as a PNG.

Small runs of the same kind as the notebooks', drawn by ``notebook_figures.py`` and written into
``figures/`` (docs/RESULTS.md shows them):

    00_kv_cache_cost.png    per-token time without vs with the KV cache, and KV bytes growing
    01_static_batch.png     a static batch: finished requests still holding their slots
    02_dynamic_holes.png    dynamic batching: requests joining and leaving, holes in the rectangle
    03_paged_blocks.png     the paged pool, block tables and blocks shared by parallel samples
    04_kernel_grid.png      which program of the decode kernel's grid reads which block
    05_fragmentation.png    three allocators, one workload, one budget

``--quick`` (or ``MINILLM_QUICK=1``) makes the model runs tiny.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from matplotlib.figure import Figure

from .accounting import SimConfig
from .replay import compare
from .live_view import LiveMemoryView
from .notebook import quick_mode
from .notebook_figures import (dynamic_holes_figure, example_block_tables, fragmentation_figure,
                               kernel_grid_figure, kv_cache_cost_figure, most_shared,
                               paged_blocks_figure, static_batch_figure)
from ..workload import WorkloadSpec

FIGURES = Path(__file__).resolve().parents[2] / "figures"
DPI = 110


def _model():
    from ..models import load_model
    return load_model("smollm2-135m-instruct")


def _items(n: int, lengths: list[int], seed: int = 0, categories=("chat",)):
    from ..request import SamplingParams
    from ..workload import make_workload
    items = make_workload(n, seed=seed, categories=categories)
    for it, k in zip(items, lengths):
        it.params = SamplingParams(max_tokens=k, ignore_eos=True)
    return items


def _watch(model, engine: str, items, **options):
    from ..llm import LLM
    from ..workload import to_requests
    llm = LLM(model, engine=engine, **options)
    view = LiveMemoryView()
    result = llm.run(to_requests(llm, items), on_step=view)
    return result, view


def make_00(model, quick: bool) -> Figure:
    items = _items(1, [8 if quick else 32], categories=("long",))
    nocache, _ = _watch(model, "naive-nocache", items)
    cached, view = _watch(model, "naive", items)
    return kv_cache_cost_figure(nocache, cached, view, model.kv_bytes_per_token)


def make_01(model, quick: bool) -> Figure:
    lengths = [3, 8, 5, 2] if quick else [8, 32, 16, 4]
    _, view = _watch(model, "static", _items(4, lengths), batch_size=4)
    return static_batch_figure(view)


def make_02(model, quick: bool) -> Figure:
    lengths = [3, 8, 2, 5, 4, 6] if quick else [6, 28, 4, 14, 10, 20, 8, 12]
    items = _items(len(lengths), lengths)
    _, static = _watch(model, "static", items, batch_size=3)
    _, dynamic = _watch(model, "dynamic", items, max_num_seqs=3)
    return dynamic_holes_figure(dynamic, static)


def make_03(model, quick: bool) -> Figure:
    from ..request import SamplingParams
    lengths = [4, 6, 3] if quick else [12, 20, 8]
    items = _items(len(lengths), lengths)
    items[0].params = SamplingParams(max_tokens=lengths[0], n=3, temperature=0.8, seed=0,
                                     ignore_eos=True)
    _, view = _watch(model, "paged", items, num_blocks=48, block_size=8)
    return paged_blocks_figure(most_shared(view))


def make_04(model, quick: bool) -> Figure:
    tables, ctx = example_block_tables()
    return kernel_grid_figure(tables, ctx, block_size=4, num_blocks=24, num_kv_heads=3)


def make_05(model, quick: bool) -> Figure:
    spec = WorkloadSpec(num_requests=24 if quick else 48, arrival_rate=2.0)
    return fragmentation_figure(compare(spec.make(), SimConfig(max_len=512,
                                                               enable_prefix_caching=False)))


JOBS = {"00_kv_cache_cost": (make_00, True), "01_static_batch": (make_01, True),
        "02_dynamic_holes": (make_02, True), "03_paged_blocks": (make_03, True),
        "04_kernel_grid": (make_04, False), "05_fragmentation": (make_05, False)}


def main(argv: list[str] | None = None) -> int:
    from tqdm.auto import tqdm

    p = argparse.ArgumentParser(prog="python -m minillm.viz.figures",
                                description="Regenerate the key figure of every notebook as a PNG "
                                            "(what `make figures` runs).")
    p.add_argument("--quick", action="store_true", help="tiny runs (also MINILLM_QUICK=1)")
    p.add_argument("--out", default=str(FIGURES), help="output folder (default: figures/)")
    p.add_argument("--only", default="", help="comma-separated figure names or prefixes (e.g. 00,05)")
    args = p.parse_args(argv)
    quick = args.quick or quick_mode()
    import torch
    # One thread: on a small shared CPU two contending threads make timings erratic (figure 00
    # plots them), and one is nearly as fast for a 135M model.
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    jobs = {k: v for k, v in JOBS.items() if not only or any(k.startswith(o) for o in only)}
    model = None
    written = []
    for name in (bar := tqdm(list(jobs), desc="figures", unit="fig")):
        bar.set_postfix_str(name)
        make, needs_model = jobs[name]
        if needs_model and model is None:
            model = _model()
        fig = make(model, quick)
        path = out / f"{name}.png"
        fig.savefig(path, dpi=DPI)
        written.append(path)
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
