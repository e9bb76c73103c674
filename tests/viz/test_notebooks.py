"""Every notebook runs headless, top to bottom, without an error (quick mode), and is stored
without outputs.

They run as a class runs them: in a handout (``lab handout``) where every exercise is a
stub and the student's ``labwork/`` holds a solution for each, so each notebook's first cell
stands the student's files in, and the ranks rungs 7, 10 and 11 spawn load them too. In the
teacher's repository ``labwork.use()`` changes nothing, so this covers that path as well."""
from __future__ import annotations

import os
import re
import time
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
EXPECTED = ["00_naive_loop", "01_static_batching", "02_dynamic_batching", "03_block_manager",
            "04_triton_kernels", "05_fragmentation_visualizer", "06_speculative_decoding",
            "07_pipeline_parallel", "08_scheduling_policies", "09_quantized_kv",
            "10_tensor_parallel", "11_disaggregation",
            "12_realtime_scheduling", "13_multi_lora", "14_compiled"]


def test_every_step_has_its_notebook():
    assert [p.stem for p in NOTEBOOKS] == EXPECTED


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, \
                f"{path.name} is stored with outputs: clear them before committing"
    assert "widgets" not in nb.metadata, f"{path.name} is stored with widget state"


def python_kernel() -> str:
    """The kernel nbclient will start: ``python3``, which jupyter_client runs with this very
    interpreter (the venv) as long as ipykernel is importable here."""
    try:
        import ipykernel  # noqa: F401
        from jupyter_client.kernelspec import KernelSpecManager
    except ImportError as e:
        pytest.fail(f"cannot run notebooks: {e}. Install the requirements (make setup) so that "
                    "ipykernel and jupyter_client are in this environment.")
    specs = KernelSpecManager().find_kernel_specs()
    if "python3" not in specs:
        pytest.fail("no 'python3' Jupyter kernel spec found; run `python -m ipykernel install "
                    "--sys-prefix` in this environment")
    return "python3"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_first_cell_stands_the_student_s_solutions_in(path):
    """Before anything of the engine is imported (a handout's stubs would be imported instead)."""
    cells = [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
    first = [line for line in cells[0].source.splitlines() if line.startswith(("from", "import"))]
    assert first and first[0].startswith("from minillm.lab import labwork; labwork.use()"), \
        f"{path.name}: the first import of its first cell must be labwork.use()"


@pytest.fixture(scope="module")
def classroom(tmp_path_factory) -> Path:
    """A handout with every exercise stubbed, solved in ``labwork/`` by a student whose code is
    the reference with one no-op statement per function (so it is the student's file that runs)."""
    from test_lab_isolation_copies import with_no_ops
    from test_lab_outside import reference

    from minillm.lab.exercises import EXERCISES
    from minillm.lab.teacher import handout
    out = handout(tmp_path_factory.mktemp("class") / "students", list(EXERCISES))
    for ex_id, ex in EXERCISES.items():
        (out / "labwork" / ex_id).mkdir(parents=True)
        (out / "labwork" / ex_id / ex.file_name).write_text(with_no_ops(reference(ex_id),
                                                                        ex.functions))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_in_a_handout_on_the_student_s_solutions(path, classroom, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(classroom))     # the kernel imports the handout's copy
    nb = run_notebook(classroom / "notebooks" / path.name, monkeypatch)
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                   for o in c.outputs)
    assert "your solutions:" in text and "yours to write" not in text, text[:2000]


def run_notebook(path, monkeypatch) -> nbformat.NotebookNode:
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    from nbclient.exceptions import DeadKernelError

    kernel = python_kernel()
    monkeypatch.setenv("MINILLM_QUICK", "1")   # the kernel inherits this process's environment
    # A kernel that dies (a crash in native code, the OOM killer) prints its Python stacks to
    # its stderr, which pytest shows under the failure; its exit status says which it was.
    monkeypatch.setenv("PYTHONFAULTHANDLER", "1")
    nb = nbformat.read(path, as_version=4)
    kernels: list = []
    client = NotebookClient(nb, kernel_name=kernel, timeout=600,
                            resources={"metadata": {"path": str(path.parent)}},
                            on_notebook_start=lambda **_: kernels.append(client.km.provisioner))
    t = time.perf_counter()
    try:
        client.execute()
    except CellExecutionError as e:
        pytest.fail(f"{path.name} failed:\n{e}")
    except DeadKernelError as e:
        process = getattr(kernels[0], "process", None) if kernels else None
        status = process.poll() if process is not None else "unknown"
        pytest.fail(f"{path.name}: its kernel died ({e}); exit status {status} (-9: killed, "
                    f"the OOM killer's signal; -11: a crash in native code; its stacks are "
                    f"in the captured stderr)")
    took = time.perf_counter() - t
    print(f"{path.name}: {took:.1f} s")     # for information only: no test asserts on time
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error"]
    assert not errors
    return nb


@pytest.mark.slow
def test_notebook_04_without_triton_says_so_and_runs(monkeypatch, tmp_path):
    """On macOS or Windows there is no Triton wheel: the kernel cells say 'skipped', the rest
    (pictures, the torch path, the live view) still runs. A stand-in package makes `import
    triton` fail in the notebook's kernel, as it does there."""
    fake = tmp_path / "triton"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('no triton on this platform (test)')\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    nb = run_notebook(ROOT / "notebooks" / "04_triton_kernels.ipynb", monkeypatch)
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "kernels can run: False" in text and "skipped: the kernels need Triton" in text


@pytest.mark.slow
def test_export_leaves_every_figure_in_the_html(tmp_path):
    """`python -m minillm.lab export` writes copies a reader can open without running anything:
    the live views' final pictures are in the page as images, not as widgets needing a kernel."""
    from minillm.lab.timings import time_notebook

    python_kernel()
    result = time_notebook(ROOT / "notebooks" / "00_naive_loop.ipynb", quick=True,
                           html_dir=tmp_path)
    html = (tmp_path / "00_naive_loop.html").read_text()
    assert result["total_s"] > 0 and result["sections"]
    images = len(re.findall(r"<img [^>]*src=\"data:image/png;base64,", html))
    views = sum(c.source.count("LiveMemoryView(") for c in nbformat.read(
        ROOT / "notebooks" / "00_naive_loop.ipynb", as_version=4).cells if c.cell_type == "code")
    assert views and images >= views, f"{images} images for {views} live views"
    assert "widget-view+json" not in html


@pytest.mark.slow
def test_lab_check_in_the_handout_judges_the_student_s_file(classroom, tmp_path):
    """In the students' copy, with the teacher's graders: the solution in labwork/ passes and a
    wrong one (one int8 scale per token across its KV heads) fails, with the grader's reason;
    the reference a grader needs is never the handout's stub nor the student's own file."""
    import subprocess
    import sys

    from minillm.lab.grade import PACKAGE_ROOT
    env = {**os.environ, "PYTHONPATH": str(classroom)}
    check = lambda *a: subprocess.run(
        [sys.executable, "-m", "minillm.lab", "check", "09", "--graders",
         str(PACKAGE_ROOT / "minillm/lab/graders"), *a], cwd=classroom, env=env,
        capture_output=True, text=True, timeout=900)
    right = check()
    assert right.returncode == 0 and "verdict: passed" in right.stdout, right.stdout[-2000:]
    mine = (classroom / "labwork" / "09" / "kv_quant.py").read_text()
    old = "amax = xf.abs().amax(dim=-1)"
    assert old in mine
    wrong = tmp_path / "kv_quant.py"
    wrong.write_text(mine.replace(
        old, "amax = xf.abs().amax(dim=-1).amax(dim=-1, keepdim=True).expand(xf.shape[:-1])"))
    done = check("--file", str(wrong), "--", "-k", "int8")     # the tests that judge the scales
    assert done.returncode != 0 and "scale must be max|x| / 127 per row" in done.stdout, \
        done.stdout[-2000:]
