"""Run the notebooks headless: how long each section takes, and copies a reader can open.

``python -m minillm.lab timings [--full] [--only 03]`` executes the notebooks (as the tests do)
with per-cell timing and prints one table per notebook: seconds per ``##`` section, the numbers of
the teacher's guide. Quick mode (``MINILLM_QUICK=1``, the default here) is what a class runs first;
``--full`` is the real workload. ``--json PATH`` keeps the numbers. ``--html DIR`` also writes each
executed notebook as HTML, widgets' final pictures included (``MINILLM_STATIC=1``), so a reader who
runs nothing sees every figure (``python -m minillm.lab export`` = ``timings --full --html
notebooks/html``).
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


def time_notebook(path: Path, quick: bool = True, timeout: int = 3600,
                  html_dir: Path | None = None) -> dict:
    """Run ``path`` headless; return its total wall time and seconds per section (and write it as
    HTML into ``html_dir``)."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    saved = {k: os.environ.get(k) for k in ("MINILLM_QUICK", "MINILLM_STATIC")}
    os.environ.pop("MINILLM_QUICK", None)      # the kernel inherits this process's environment
    os.environ.pop("MINILLM_STATIC", None)
    if quick:
        os.environ["MINILLM_QUICK"] = "1"
    if html_dir is not None:
        os.environ["MINILLM_STATIC"] = "1"
    try:
        client = NotebookClient(nb, kernel_name="python3", timeout=timeout, record_timing=True,
                                resources={"metadata": {"path": str(path.parent)}})
        t = time.perf_counter()
        client.execute()
        total = time.perf_counter() - t
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if html_dir is not None:
        write_html(nb, Path(html_dir) / f"{path.stem}.html")
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


def _readable(output) -> bool:
    """Whether an output means something in a page nobody runs: not a live widget (it needs a
    kernel; the static export leaves a picture of its last frame right after it) and not a
    progress bar on stderr (loading weights)."""
    if "application/vnd.jupyter.widget-view+json" in output.get("data", {}):
        return False
    text = output.get("text", "") if output.get("output_type") == "stream" else ""
    return not (output.get("name") == "stderr" and ("\r" in text or "it/s]" in text))


def write_html(nb, out: Path) -> Path:
    """The executed notebook as one self-contained HTML page (images embedded)."""
    from nbconvert import HTMLExporter

    for cell in nb.cells:
        if "outputs" in cell:
            cell.outputs = [o for o in cell.outputs if _readable(o)]
    nb.metadata.pop("widgets", None)
    body, _ = HTMLExporter(template_name="lab").from_notebook_node(nb)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(body, encoding="utf-8")
    return out


def format_timings(result: dict) -> str:
    mode = "quick" if result["quick"] else "full"
    lines = [f"{result['notebook']} ({mode} mode): {result['total_s']:.0f} s in all, kernel "
             "start included", "| section | seconds |", "|---|---|"]
    lines += [f"| {k} | {v:.1f} |" for k, v in result["sections"].items()]
    return "\n".join(lines)


def main(full: bool = False, only: str = "", json_path: str | None = None,
         html_dir: str | None = None) -> int:
    paths = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
    wanted = [s.strip() for s in only.split(",") if s.strip()]
    paths = [p for p in paths if not wanted or any(p.stem.startswith(w) for w in wanted)]
    results = []
    for path in paths:
        print(f"running {path.name} ({'full' if full else 'quick'} mode)…", flush=True)
        results.append(time_notebook(path, quick=not full,
                                     html_dir=Path(html_dir) if html_dir else None))
        print(format_timings(results[-1]) + "\n", flush=True)
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=1))
    return 0
