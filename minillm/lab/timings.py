"""How long each notebook, and each section of it, takes: the numbers of the teacher's guide.

``python -m minillm.lab timings [--full] [--only 03]`` executes the notebooks headless (as the
tests do) with per-cell timing, and prints one table per notebook: seconds per ``##`` section.
Quick mode (``MINILLM_QUICK=1``, the default here) is what a class runs first; ``--full`` is
the real workload. ``--json PATH`` keeps the numbers.
"""
from __future__ import annotations

import json
import os
import time
from datetime import datetime
from pathlib import Path

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def _seconds(meta: dict) -> float:
    ex = meta.get("execution", {})
    start, end = ex.get("iopub.execute_input"), ex.get("shell.execute_reply")
    if not start or not end:
        return 0.0
    parse = lambda s: datetime.fromisoformat(s.replace("Z", "+00:00"))   # noqa: E731
    return (parse(end) - parse(start)).total_seconds()


def time_notebook(path: Path, quick: bool = True, timeout: int = 3600) -> dict:
    """Run ``path`` headless; return its total wall time and seconds per section."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    saved = os.environ.get("MINILLM_QUICK")
    if quick:
        os.environ["MINILLM_QUICK"] = "1"     # the kernel inherits this process's environment
    else:
        os.environ.pop("MINILLM_QUICK", None)
    try:
        client = NotebookClient(nb, kernel_name="python3", timeout=timeout, record_timing=True,
                                resources={"metadata": {"path": str(path.parent)}})
        t = time.perf_counter()
        client.execute()
        total = time.perf_counter() - t
    finally:
        if saved is None:
            os.environ.pop("MINILLM_QUICK", None)
        else:
            os.environ["MINILLM_QUICK"] = saved
    sections: dict[str, float] = {}
    current = "(set-up)"
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            heads = [ln for ln in cell.source.splitlines() if ln.startswith("## ")]
            if heads:
                current = heads[-1][3:].strip()
        elif cell.cell_type == "code":
            sections[current] = sections.get(current, 0.0) + _seconds(cell.metadata)
    return {"notebook": path.stem, "quick": quick, "total_s": round(total, 1),
            "sections": {k: round(v, 1) for k, v in sections.items()}}


def format_timings(result: dict) -> str:
    mode = "quick" if result["quick"] else "full"
    lines = [f"{result['notebook']} ({mode} mode): {result['total_s']:.0f} s in all, kernel "
             "start included", "| section | seconds |", "|---|---|"]
    lines += [f"| {k} | {v:.1f} |" for k, v in result["sections"].items()]
    return "\n".join(lines)


def main(full: bool = False, only: str = "", json_path: str | None = None) -> int:
    paths = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
    wanted = [s.strip() for s in only.split(",") if s.strip()]
    paths = [p for p in paths if not wanted or any(p.stem.startswith(w) for w in wanted)]
    results = []
    for path in paths:
        print(f"running {path.name} ({'full' if full else 'quick'} mode)…", flush=True)
        results.append(time_notebook(path, quick=not full))
        print(format_timings(results[-1]) + "\n", flush=True)
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=1))
    return 0
