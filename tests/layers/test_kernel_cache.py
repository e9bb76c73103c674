"""The C++ kernel's build cache (``cpp_build.py``): one build directory per toolchain, a build
killed mid-compile never blocks the next one, and nothing waits for ever -- a live lock holder or
a stuck compiler past ``MINILLM_CPP_BUILD_TIMEOUT_S`` means the torch backend and a warning.

Each test builds in its own ``TORCH_EXTENSIONS_DIR``; only the kill-mid-compile test compiles
for real (once, ~45 s here), the others stop before a compiler is needed or fake it."""
from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from minillm.engines import get_attention_backend
from minillm.layers.attention import cpp as cpu_attention, cpp_build
from minillm.layers.attention.cpp_build import BUILDING, current_inputs, kernel_name

ROOT = Path(__file__).resolve().parents[2]
SOURCE = cpu_attention._SOURCE

pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"),
                                 reason="looks for the build's processes in /proc"),
              pytest.mark.slow]     # runs the C++ compiler: not in make test-fast


def build_dir(root: Path) -> Path:
    """Where a build under ``root`` goes, for this process's toolchain (and $CXX)."""
    return root / kernel_name(current_inputs(SOURCE, *cpu_attention._flags()))


def working_in(path: Path) -> list[int]:
    """Processes whose current directory is ``path``: the builder, ninja, the compiler."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and os.readlink(proc / "cwd") == str(path):
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def wait_until(condition, what: str, timeout_s: float = 240.0) -> None:
    """A guard against a hang, not a timing assertion."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting: {what}"
        time.sleep(0.1)


def fresh_state(monkeypatch, root: Path, timeout_s: str | None = None) -> None:
    """``load_kernel`` in this process as on a machine that never built the kernel."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(root))
    if timeout_s is not None:
        monkeypatch.setenv(cpp_build.TIMEOUT_ENV, timeout_s)
    monkeypatch.setattr(cpu_attention, "_state", {})


def test_build_directory_names_everything_in_the_build(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    flags = cpu_attention._flags()
    base = current_inputs(SOURCE, *flags)
    assert kernel_name(current_inputs(SOURCE, *flags)) == kernel_name(base)    # stable
    assert build_dir(tmp_path).parent == tmp_path == cpp_build.build_root()
    assert base.torch_path == str(Path(torch.__file__).resolve().parent)
    # Two torch installations (another venv, another version): two build directories.
    monkeypatch.setattr(torch, "__file__", "/elsewhere/venv/site-packages/torch/__init__.py")
    other_venv = current_inputs(SOURCE, *flags)
    assert other_venv.torch_path == "/elsewhere/venv/site-packages/torch"
    monkeypatch.setattr(torch, "__version__", "2.99.0+cpu")
    other_version = current_inputs(SOURCE, *flags)
    variants = [base, other_venv, other_version] + [
        dataclasses.replace(base, **{field: value}) for field, value in [
            ("python", "CPython 3.12.1 /usr/include/python3.12"), ("compiler", "c++: clang 18"),
            ("cflags", base.cflags + ("-DNDEBUG",)), ("ldflags", ()),
            ("source_sha256", "0" * 64), ("cpu", "x86_64 sse2")]]
    assert len({kernel_name(v) for v in variants}) == len(variants)


def test_a_header_beside_the_source_is_part_of_the_build(tmp_path):
    """The decode kernel's source includes the headers beside it (csrc/*.h): an edit to one is a
    new build directory, as an edit to the source is; a file that is not a header is not."""
    src = tmp_path / "k.cpp"
    src.write_text('#include "a.h"\n')
    (tmp_path / "a.h").write_text("// one\n")
    first = cpp_build.source_digest(src)
    (tmp_path / "notes.txt").write_text("not compiled")
    assert cpp_build.source_digest(src) == first
    (tmp_path / "a.h").write_text("// two\n")
    second = cpp_build.source_digest(src)
    assert second != first
    (tmp_path / "b.h").write_text("")
    assert cpp_build.source_digest(src) not in (first, second)
    assert {h.name for h in SOURCE.parent.glob("*.h")} >= {"avx512_tiles.h", "paged_extend.h"}


def test_bad_timeout_is_an_error_naming_the_variable(monkeypatch):
    for bad in ("soon", "0", "-5", "nan"):
        monkeypatch.setenv(cpp_build.TIMEOUT_ENV, bad)
        with pytest.raises(ValueError, match=rf"MINILLM_CPP_BUILD_TIMEOUT_S must be a number of "
                                             rf"seconds > 0, got '{bad}'"):
            cpp_build.build_timeout_s()


def test_live_lock_holder_past_the_timeout_falls_back_with_a_warning(tmp_path, monkeypatch):
    fresh_state(monkeypatch, tmp_path, timeout_s="2")
    where = build_dir(tmp_path)
    where.mkdir()
    fd = os.open(where / cpp_build.LOCK_FILE, os.O_RDWR | os.O_CREAT)
    try:   # this process is the live builder that never finishes
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": "here", "started": time.time()})
                 .encode())
        with pytest.warns(UserWarning, match=rf"could not be built \(another process \(pid "
                                             rf"{os.getpid()} on here, since .*\) held the build "
                                             r"lock .* for longer than 2 s \(MINILLM_CPP_BUILD_"
                                             r"TIMEOUT_S\)\); using the torch reference"):
            assert cpu_attention.load_kernel() is None
        assert get_attention_backend(None, torch.device("cpu")).name == "torch"
    finally:
        os.close(fd)
    assert not (where / cpp_build.DONE_FILE).exists() and not working_in(where)


def test_stuck_compiler_is_killed_at_the_timeout(tmp_path, monkeypatch):
    """A compiler that never returns: the builder's whole process group is killed at the
    deadline, and the engine gets the torch backend with a warning."""
    (tmp_path / "bin").mkdir()   # named g++, so that torch accepts it as a compiler
    fake, pidfile = tmp_path / "bin" / "g++", tmp_path / "compiler.pid"
    fake.write_text(f"#!/bin/sh\ncase \"$1\" in\n  --version) echo 'fake c++ 1.0';;\n"
                    f"  -dumpfullversion) echo 12.2.0;;\n"
                    f"  *) echo $$ > {pidfile}; exec sleep 600;;\nesac\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    fresh_state(monkeypatch, tmp_path / "ext", timeout_s="20")
    where = build_dir(tmp_path / "ext")
    with pytest.warns(UserWarning, match=r"could not be built \(the build did not finish in 20 s "
                                         r"\(MINILLM_CPP_BUILD_TIMEOUT_S\)\)"):
        assert cpu_attention.load_kernel() is None
    wait_until(lambda: not working_in(where), "the builder's processes to end", 30)
    if pidfile.exists():   # the compile had started (on a very slow machine it may not have)
        pid = int(pidfile.read_text())
        wait_until(lambda: not Path(f"/proc/{pid}").exists() or
                   Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z",
                   "the stuck compiler to be killed", 30)


ENGINE = """
import json, warnings
from minillm import LLM, SamplingParams
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    outs = {}
    for backend in (None, "torch"):
        # eager layer ops: the fused ones are an extension of their own, whose build in this
        # fresh TORCH_EXTENSIONS_DIR doubled the compiling this test waits for
        llm = LLM("tiny-llama", engine="paged", attention_backend=backend, layer_ops="eager")
        outs[llm.engine.backend.name] = [o.token_ids for o in llm.generate(
            [[5, 6, 7], list(range(3, 40))], SamplingParams(max_tokens=8, ignore_eos=True))]
print(json.dumps({"outs": outs, "warnings": [str(w.message) for w in caught]}))
"""


def test_build_killed_mid_compile_then_the_next_engine_builds(tmp_path, monkeypatch, capfd):
    """SIGKILL the process building the kernel while the compiler runs: its builder, ninja and
    the compiler stop; our lock file stays, naming a dead builder, and so may torch's ``lock``
    (torch's stays after a SIGKILL: a later build that waited for it would wait for ever).
    The next paged engine builds afresh and uses the kernel; the one after imports that build."""
    root = tmp_path / "ext"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(root))
    where = build_dir(root)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen([sys.executable, "-c", "from minillm.layers.attention.cpp "
                              "import load_kernel; load_kernel()"], env=env, cwd=ROOT,
                             stderr=subprocess.PIPE, text=True)
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(first.stderr), daemon=True)
    reader.start()
    try:   # the compiler is running once ninja's child works in the directory
        wait_until(lambda: BUILDING in "".join(err) and (where / cpp_build.TORCH_LOCK).exists()
                   and len(working_in(where)) >= 3 or first.poll() is not None,
                   "the compiler to start")
        assert first.poll() is None, "".join(err)
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=60)
    finally:
        first.kill()
    reader.join(timeout=10)
    holder = json.loads((where / cpp_build.LOCK_FILE).read_text())["pid"]
    # the compiler leaves the directory first, the builder (a session leader) a moment later:
    # on a loaded machine that moment was long enough to fail an immediate check
    wait_until(lambda: not working_in(where) and holder not in cpp_build.session(holder),
               "the orphaned build and its builder to stop", 60)
    assert not (where / cpp_build.DONE_FILE).exists()
    (where / cpp_build.TORCH_LOCK).touch()   # torch's lock, as a SIGKILLed build leaves it

    run = subprocess.run([sys.executable, "-c", ENGINE], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.splitlines()[-1])
    assert not [w for w in result["warnings"] if "C++" in w], result["warnings"]
    assert BUILDING in run.stderr and "waiting" not in run.stderr
    assert set(result["outs"]) == {"cpp", "torch"} and result["outs"]["cpp"] == \
        result["outs"]["torch"]
    assert (where / cpp_build.DONE_FILE).exists() and not (where / cpp_build.TORCH_LOCK).exists()
    # and a later process (this one) imports that build: no second build
    capfd.readouterr()
    assert hasattr(cpp_build.load_cached(SOURCE, *cpu_attention._flags()), "paged_decode")
    assert BUILDING not in capfd.readouterr().err
