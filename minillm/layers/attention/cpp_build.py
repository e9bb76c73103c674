"""Building the C++ kernels once per toolchain, never hanging (notebook 04).

``torch.utils.cpp_extension.load`` names its build directory after the extension only (two
checkouts in one home rebuild it for each other), its lock (O_EXCL, no pid) outlives a killed
build and stalls every later one silently, and a build has no time bound. So here:

1. **The directory is named after everything in the build** (``BuildInputs``): torch's version
   and install path, Python, the compiler (``$CXX --version``), the flags, the hash of the source
   and its ``headers``, the CPU's feature flags (``-march=native``). All are copied there and
   built there, one build per source and toolchain, a ``built`` file once it finished.
2. **The lock is ``minillm.lock``, held with ``flock``**: the kernel releases it however its
   holder dies. It names its holder (pid, host, start) for a waiting process.
3. **The build runs in a subprocess, bounded** by ``MINILLM_CPP_BUILD_TIMEOUT_S`` (default 300 s;
   past it, the torch backend and one warning saying why). The builder (this file as a script:
   the standard library only at the top) leads its own session and stops all of it (ninja, the
   compilers) at its deadline or when its asker dies; the ``.so`` is imported in-process.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import hashlib
import importlib.util
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

LOCK_FILE = "minillm.lock"     # ours: flock'd by the one live builder
TORCH_LOCK = "lock"            # torch's FileBaton: stale whenever nobody holds ours
DONE_FILE = "built"            # written once the built module imported
TIMEOUT_ENV, DEFAULT_TIMEOUT_S = "MINILLM_CPP_BUILD_TIMEOUT_S", 300.0
GRACE_S = 30.0                 # the builder's own deadline comes first; this bounds a stuck one
BUILDING = "building the C++ paged-attention kernel once (~45 s)..."
_stopping = threading.Event()  # the builder is stopping its session (deadline, parent gone)


class BuildError(RuntimeError):
    """The kernel could not be built or loaded here; the message says why."""


@dataclasses.dataclass(frozen=True)
class BuildInputs:
    """Everything the compiled ``.so`` depends on: a change in any of them is another build."""

    torch_version: str
    torch_path: str
    python: str
    compiler: str
    cflags: tuple[str, ...]
    ldflags: tuple[str, ...]
    source_sha256: str
    cpu: str


def kernel_name(inputs: BuildInputs, stem: str = "minillm_paged_decode") -> str:
    """The extension's name, and its build directory's: ``stem`` + a hash of ``inputs``."""
    blob = json.dumps(dataclasses.asdict(inputs), sort_keys=True).encode()
    return f"{stem}_{hashlib.sha256(blob).hexdigest()[:16]}"


def headers(source: Path) -> list[Path]:
    """What ``source`` may include, by name: headers beside it and the core's (``layers/csrc``)."""
    shared = Path(__file__).resolve().parents[1] / "csrc"
    found = {h.name: h for d in (shared, source.parent) for h in d.glob("*.h")}
    return [found[name] for name in sorted(found)]


def source_digest(source: Path) -> str:
    """sha256 of ``source`` and its ``headers``: an edit to any of them is a build."""
    digest = hashlib.sha256(source.read_bytes())
    for header in headers(source):
        digest.update(header.name.encode() + b"\0" + header.read_bytes())
    return digest.hexdigest()


def current_inputs(source: Path, cflags: list[str], ldflags: list[str]) -> BuildInputs:
    import torch

    return BuildInputs(
        torch_version=torch.__version__, torch_path=str(Path(torch.__file__).resolve().parent),
        python=f"{platform.python_implementation()} {platform.python_version()}{sys.abiflags} "
               f"{sysconfig.get_paths()['include']}",
        compiler=compiler_id(os.environ.get("CXX", "c++")), cflags=tuple(cflags),
        ldflags=tuple(ldflags), source_sha256=source_digest(source), cpu=cpu_id())


@functools.lru_cache(maxsize=None)
def compiler_id(cxx: str) -> str:
    """``cxx --version`` (what torch compiles with: $CXX, else ``c++``), once per process."""
    try:
        run = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BuildError(f"no usable C++ compiler: {cxx} --version failed ({e})") from None
    if run.returncode != 0:
        raise BuildError(f"no usable C++ compiler: {cxx} --version exited with {run.returncode}")
    return f"{cxx}: {run.stdout.strip()}"


def cpu_id() -> str:
    """The machine and its CPU feature flags (``-march=native`` builds for exactly these)."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = platform.processor()
    return f"{platform.machine()} {' '.join(sorted(flags.partition(':')[2].split()))}"


def build_root() -> Path:
    """Where torch keeps JIT extensions: ``$TORCH_EXTENSIONS_DIR``, else its default root."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    from torch.utils.cpp_extension import get_default_build_root
    return Path(get_default_build_root())


def build_timeout_s() -> float:
    raw = os.environ.get(TIMEOUT_ENV, "")
    try:
        value = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{TIMEOUT_ENV} must be a number of seconds > 0, got {raw!r}")
    return value


# --- the asking process: import a finished build, or run the builder (bounded) -------------------
def load_cached(source: Path, cflags: list[str], ldflags: list[str], stem: str = "minillm_paged_decode"):
    """The compiled module (named ``stem`` + a hash of its inputs), built first if this toolchain
    has no finished build yet; BuildError (a failed, overrunning or locked-out build) says why."""
    timeout_s = build_timeout_s()
    name = kernel_name(current_inputs(source, cflags, ldflags), stem)
    build_dir = build_root() / name
    done = build_dir / DONE_FILE
    if done.exists():
        try:
            return import_built(build_dir, name)
        except (ImportError, OSError):
            done.unlink(missing_ok=True)   # damaged since (a .so removed): build it again
    run_builder(build_dir, name, source, cflags, ldflags, timeout_s)
    return import_built(build_dir, name)


def import_built(build_dir: Path, name: str):
    """Import the built extension module (what torch's ``load`` does once it has built)."""
    path = build_dir / f"{name}{'.pyd' if sys.platform == 'win32' else '.so'}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def run_builder(build_dir: Path, name: str, source: Path, cflags: list[str],
                ldflags: list[str], timeout_s: float) -> None:
    import torch

    build_dir.mkdir(parents=True, exist_ok=True)
    spec = {"name": name, "build_dir": str(build_dir), "source": str(source.resolve()),
            "cflags": cflags, "ldflags": ldflags, "deadline": time.time() + timeout_s,
            "timeout_s": timeout_s, "torch_parent": str(Path(torch.__file__).parent.parent)}
    # Run as a script from the build directory: sys.path[0] is then that directory (run
    # directly, it would be this package's, whose engine.py, model.py... could shadow modules).
    run_script = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], " \
                 "run_name='__main__')"
    proc = subprocess.Popen([sys.executable, "-c", run_script, str(Path(__file__).resolve()),
                             json.dumps(spec)], cwd=build_dir, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)   # its own group: killable as a whole
    try:
        out, _ = proc.communicate(timeout=timeout_s + GRACE_S)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        raise BuildError(f"the build did not finish in {timeout_s:g} s ({TIMEOUT_ENV})") from None
    except BaseException:   # Ctrl-C while waiting: the compile stops with us
        kill_group(proc)
        raise
    if proc.returncode != 0:
        lines = [line for line in out.splitlines() if line.strip()]
        raise BuildError(lines[-1].removeprefix("error: ") if lines
                         else f"the builder exited with code {proc.returncode}")


def kill_group(proc: subprocess.Popen) -> None:
    """The builder and everything it started (ninja, the compiler)."""
    stop_session(proc.pid) if hasattr(os, "killpg") else proc.kill()
    proc.wait()


def stop_session(sid: int) -> None:
    """Stop a builder's session: SIGTERM to its process group first -- ninja passes it on to each
    compile, run in a process group of its own (a SIGKILL to the builder's group alone would
    leave the compiler running) -- then SIGKILL what is left of the session (found in /proc on
    Linux), the caller last if it belongs to it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(sid, signal.SIGTERM)
    deadline = time.monotonic() + 3.0
    while session(sid) - {os.getpid()} and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in session(sid) - {os.getpid()}:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(sid, signal.SIGKILL)


def session(sid: int) -> set[int]:
    """The live processes of session ``sid`` (Linux; elsewhere none are found)."""
    pids = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if fields[3] == str(sid) and fields[0] != "Z":
            pids.add(int(stat.parent.name))
    return pids


# --- the builder (this file run as a script) ------------------------------------------------------
def builder_main(spec: dict) -> int:
    """Take the lock (waiting for a live holder until the deadline), then build unless another
    builder just did. Exit 0: built; 1: failed, with ``error: why`` as the last line of stdout."""
    deadline = spec["deadline"]
    # SIGTERM is for ninja and the compilers (``stop_session``): this process stops them all.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    die_with_parent(os.getppid())
    build_dir = Path(spec["build_dir"])
    try:
        acquire(build_dir / LOCK_FILE, deadline, spec["timeout_s"])   # held until we exit
        # From here the time left bounds the compile (``acquire`` bounded the wait for the lock).
        timer = threading.Timer(max(0.0, deadline - time.time()), expire, (spec["timeout_s"],))
        timer.daemon = True
        timer.start()
        if not (build_dir / DONE_FILE).exists():   # (another builder may have just finished)
            build(spec, build_dir)
    except Exception as e:
        if _stopping.is_set():   # ninja failed because we stop it: let the stopping finish
            time.sleep(60)
        elif isinstance(e, BuildError):
            print(f"error: {e}", flush=True)
        else:   # torch's build error holds the compiler's output: its last line
            text = str(e).strip()
            print(f"error: {type(e).__name__}: {text.splitlines()[-1][:300] if text else ''}",
                  flush=True)
        os._exit(1)
    os._exit(0)


def acquire(path: Path, deadline: float, timeout_s: float) -> int | None:
    """``flock`` ``path`` (one builder per directory), then write who holds it. Without
    ``fcntl`` (Windows), or on a file system without locks, there is none: torch's must do."""
    try:
        import fcntl
    except ImportError:
        return None
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    said = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            holder = read_holder(path)
            if time.time() >= deadline:
                raise BuildError(f"another process ({holder}) held the build lock {path} for "
                                 f"longer than {timeout_s:g} s ({TIMEOUT_ENV})") from None
            if not said:
                print(f"waiting for {holder}, which is building the C++ paged-attention kernel...",
                      file=sys.stderr, flush=True)
                said = True
            time.sleep(0.2)
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            os.close(fd)
            return None
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                             "started": time.time()}).encode())
    return fd


def read_holder(path: Path) -> str:
    try:
        info = json.loads(path.read_text())
        started = time.strftime("%H:%M:%S", time.localtime(info["started"]))
        return f"pid {info['pid']} on {info['host']}, since {started}"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


def build(spec: dict, build_dir: Path) -> None:
    # We hold the lock: whatever is here is a killed build's (a half-written .o looks done): clean
    for path in build_dir.iterdir():
        if path.name != LOCK_FILE:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    source = build_dir / Path(spec["source"]).name
    shutil.copyfile(spec["source"], source)   # built from here: no checkout's path in the build
    for header in headers(Path(spec["source"])):   # with what it includes (in the hash)
        shutil.copyfile(header, build_dir / header.name)
    print(BUILDING, file=sys.stderr, flush=True)
    if spec["torch_parent"] not in sys.path:   # the asking process's torch, whatever the path
        sys.path.insert(0, spec["torch_parent"])
    from torch.utils.cpp_extension import load
    load(spec["name"], [str(source)], build_directory=str(build_dir),
         extra_cflags=spec["cflags"], extra_ldflags=spec["ldflags"], verbose=False)
    (build_dir / DONE_FILE).write_text(json.dumps({"pid": os.getpid(), "built": time.time()}))


def die_with_parent(parent: int, poll_s: float = 0.5) -> None:
    """The process that asked for the build is gone (killed, even outright): stop compiling."""
    def watch():
        while os.getppid() == parent:
            time.sleep(poll_s)
        kill_own_group()
    threading.Thread(target=watch, daemon=True).start()


def expire(timeout_s: float) -> None:
    _stopping.set()   # (before the message: it must be the last line the asking process reads)
    print(f"error: the build did not finish in {timeout_s:g} s ({TIMEOUT_ENV})", flush=True)
    kill_own_group()


def kill_own_group() -> None:
    """This builder, ninja and the compiler: its whole session (when it leads one)."""
    _stopping.set()
    if hasattr(os, "getsid") and os.getsid(0) == os.getpid():
        stop_session(os.getpid())
    os._exit(1)


if __name__ == "__main__":
    sys.exit(builder_main(json.loads(sys.argv[1])))
