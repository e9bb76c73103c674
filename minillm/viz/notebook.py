"""Notebook set-up: the preamble every notebook (00-05) runs, and its plain-text run tables.

``setup()`` (quick mode and torch threads), ``forward_seconds`` and ``comparison_table`` (one line
per engine of a notebook's comparison). No drawing here: pictures are in ``plots.py`` and
``notebook_figures.py``, widgets in ``live_view.py`` and ``visualizer.py``.
"""
from __future__ import annotations

import getpass
import os
import tempfile
from pathlib import Path


def quick_mode() -> bool:
    """``MINILLM_QUICK=1``: every notebook and figure runs tiny workloads (tests, CI)."""
    return os.environ.get("MINILLM_QUICK", "") not in ("", "0")


def scratch_dir() -> Path:
    """A per-user temporary folder for traces (never a path shared by every user of the machine)."""
    try:
        user = getpass.getuser()
    except Exception:            # no login name (a container without a passwd entry)
        user = str(getattr(os, "getuid", lambda: "user")())
    (path := Path(tempfile.gettempdir()) / f"minillm-{user}").mkdir(parents=True, exist_ok=True)
    return path


def static_export() -> bool:
    """``MINILLM_STATIC=1`` (set by ``python -m minillm.lab export``): widgets also leave a plain
    picture of their final state in the output, so an exported notebook shows every figure to a
    reader who runs nothing (widgets need a live kernel)."""
    return os.environ.get("MINILLM_STATIC", "") not in ("", "0")


def setup(quick: bool | None = None) -> bool:
    """Notebook preamble: returns whether quick mode is on. In quick mode, and on machines with
    two cores or fewer, torch gets one thread: on a small shared CPU two threads contending with
    other work run many times slower than one (and make the timings in the plots erratic)."""
    quick = quick_mode() if quick is None else quick
    if quick or (os.cpu_count() or 1) <= 2:
        import torch
        torch.set_num_threads(1)
    return quick


def forward_seconds(result) -> float:
    """Time spent in forward passes (the StepRecords' prefill + decode ms): unlike the wall clock,
    it leaves out whatever an ``on_step`` callback (a live view drawing) costs."""
    return sum(s.prefill_ms + s.decode_ms for s in result.steps) / 1000.0


def comparison_table(runs: dict, bytes_per_slot: int | None = None) -> str:
    """One line per engine: steps, wall and forward time, throughput, TTFT, KV peak and waste."""
    head = (f"{'engine':24s} {'steps':>5s} {'wall s':>7s} {'forward s':>9s} {'tok/s':>7s} "
            f"{'TTFT p50':>8s} {'peak KV':>9s} {'KV waste':>8s}")
    lines = [head]
    for name, res in runs.items():
        m = res.metrics
        fwd = forward_seconds(res)
        peak = (f"{m.peak_kv_allocated_bytes / 2**20:7.1f}Mi" if bytes_per_slot is None else
                f"{m.peak_kv_allocated_bytes // bytes_per_slot:6d} sl")
        lines.append(f"{name:24s} {m.num_steps:5d} {m.duration_s:7.2f} {fwd:9.2f} "
                     f"{m.output_tokens / fwd if fwd else 0:7.1f} {m.ttft_p50_s:7.2f}s {peak:>9s} "
                     f"{m.kv_waste_pct:7.1f}%")
    lines.append("(tok/s: output tokens per second of forward time; wall s also counts drawing and "
                 "Python overhead)")
    return "\n".join(lines)
