"""Inside the students' jail: the process that starts every student's process of a grading.

A student's process spent ~4 s of each grading importing torch and Hugging Face's Llama before
it ran a line of the student's code (``make test``: ~150 gradings). This process, started once
per grading process (``zygote.py``) as the PID 1 of a jail built as ``jail.py`` builds one,
imports them once and forks a student's process per request, which starts ready. No student
code ever runs here: only in the forks, once each has been walled off as ``jail.py`` walls off
a fresh process —

- a mount namespace of its own: its tree (``/trees/<name>/tree``, staged by the grading process)
  read-only at ``/lab``, an empty filesystem over ``/trees`` (no other student's tree), a fresh
  ``/tmp`` and ``/dev/shm``; a PID, IPC and network namespace of its own (a loopback only);
- the PID 1 of its PID namespace is a fork that reaps and ends with the student's process: the
  kernel then kills whatever it left, as with a jail of its own;
- the student's process closes every descriptor but its three pipes (never this process's
  socket), takes the jail's limits and drops to ``nobody`` (``jail.confine``), then runs
  ``/lab/_minillm_child.py`` as ``python -S`` would.

Requests come over a socket the grading process holds the other end of (JSON, with the three
pipes passed as descriptors): ``spawn`` and ``kill``; each fork's exit code goes back. The
socket's end is this process's end: the kernel then kills every process of the jail.
Imports only the standard library at import time (``jail.py`` loads this file before the jail
holds anything else).
"""
import json
import os
import runpy
import select
import signal
import socket
import sys
import traceback

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWNET, CLONE_NEWPID = 0x20000, 0x08000000, 0x40000000, 0x20000000
PRELOAD = ("torch", "numpy", "safetensors", "transformers",
           "transformers.models.llama.modeling_llama", "transformers.models.qwen2.modeling_qwen2")


def serve(spec: dict, jail) -> int:
    """The loop of the jail's PID 1 (``jail.build`` done): preload, then fork on request."""
    z = spec["zygote"]
    os.environ.clear()
    os.environ.update(spec["env"])          # OMP_NUM_THREADS and the like, read by the imports
    sys.path.extend(p for p in z["pythonpath"] if p not in sys.path)
    jail._c("prctl", 4, 0, 0, 0, 0)         # PR_SET_DUMPABLE 0: no process of its user reads it
    for name in PRELOAD:
        try:
            __import__(name)
        except Exception:      # noqa: BLE001 - a child imports what it needs itself
            pass
    sock = socket.socket(fileno=z["fd"])
    pids: dict[int, int] = {}               # fork's pid -> the request's id
    while True:
        if select.select([sock], [], [], 0.05)[0]:
            msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 3)
            if not msg:
                return 0                     # the grading process is gone: so is the jail
            req = json.loads(msg)
            if req["op"] == "spawn":
                pid = os.fork()
                if pid == 0:
                    sock.close()             # this run's limits: the grading's, as it asks now
                    _forked(_walled_off, req, fds, {**spec, "limits": req["limits"],
                                                    "tmp_mb": req["limits"]["tmp_mb"]}, jail)
                pids[pid] = req["id"]
                for fd in fds:
                    os.close(fd)
            elif req["op"] == "kill":       # SIGTERM: its PID 1 kills all and reports the
                for pid, rid in pids.items():  # student's own exit code if it had ended already
                    if rid == req["id"]:
                        os.kill(pid, signal.SIGTERM)
        while pids:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid in pids:
                reply = {"id": pids.pop(pid), "exit": jail.exit_code(status)}
                sock.send(json.dumps(reply).encode())


def _forked(fn, *args) -> None:
    """The body of a fork: whatever happens in ``fn``, the fork ends here, with its code (never
    back in the frames it was forked from: the zygote's loop)."""
    code = 127
    try:
        code = fn(*args)
    except BaseException:       # noqa: BLE001
        traceback.print_exc()
    finally:
        os._exit(code)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except OSError:             # nothing left to signal: it ended already
        pass


def _walled_off(req: dict, fds: list[int], spec: dict, jail) -> int:
    """The fork: a jail of its own (the module docstring), its PID 1, and in it the student's
    process. Returns the exit code of that PID 1."""
    try:
        jail._c("prctl", 1, int(signal.SIGKILL), 0, 0, 0)   # PR_SET_PDEATHSIG: dies with us
        jail._c("unshare", CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWNET)
        jail._mount(None, "/", None, jail.MS_REC | jail.MS_PRIVATE)
        tree = os.path.normpath(os.path.join("/trees", req["tree"]))
        if not tree.startswith("/trees/"):
            raise ValueError(f"a tree outside /trees: {req['tree']!r}")
        jail._bind(tree, "/lab")
        jail._mount("tmpfs", "/trees", "tmpfs", jail.MS_RDONLY, "size=4k")
        for d in ("/tmp", "/dev/shm"):
            jail._mount("tmpfs", d, "tmpfs", jail.MS_NOSUID | jail.MS_NODEV,
                        f"size={spec['tmp_mb']}m,mode=1777")
        jail._loopback_up()
        pid = os.fork()
        if pid == 0:
            _forked(_pid_one, req, fds, spec, jail)
        signal.signal(signal.SIGTERM, lambda *_: _signal(pid, signal.SIGTERM))
    except BaseException as e:       # noqa: BLE001 - the jail could not be made
        os.write(fds[2], f"minillm lab zygote: {e}\n".encode())
        return 127
    for fd in fds:
        os.close(fd)
    _, status = os.waitpid(pid, 0)
    return jail.exit_code(status)


def _pid_one(req: dict, fds: list[int], spec: dict, jail) -> int:
    """The PID 1 of the fork's namespace: a ``/proc`` of its own, the student's process, reaped
    with whatever it starts (as ``jail.main``)."""
    jail._c("prctl", 1, int(signal.SIGKILL), 0, 0, 0)
    jail._mount("proc", "/proc", "proc", jail.MS_NOSUID | jail.MS_NODEV | jail.MS_NOEXEC)
    pid = os.fork()
    if pid == 0:
        try:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            for i, fd in enumerate(fds):
                os.dup2(fd, i)
            os.closerange(3, 1 << 16)
            jail.confine(spec)
            if spec["uid"] is None:
                _drop_capabilities()         # no exec follows to drop them, as in jail.main
            os.chdir("/lab")
        except BaseException as e:   # noqa: BLE001
            os.write(2, f"minillm lab zygote: {e}\n".encode())
            os._exit(127)
        _forked(_run_child, req["env"])
    # asked to stop: everything of the namespace dies, and the student's process is reaped as
    # it ended (killed, or its own exit code if it had ended already)
    signal.signal(signal.SIGTERM, lambda *_: _signal(-1, signal.SIGKILL))
    for fd in fds:
        os.close(fd)
    return jail.reap(pid)


def _drop_capabilities() -> None:
    """capset(2) to nothing: the root of a user namespace keeps its capabilities until an exec,
    and the student's process here is never exec'd."""
    import ctypes
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)          # _LINUX_CAPABILITY_VERSION_3, self
    data = (ctypes.c_uint32 * 6)()                         # effective, permitted, inheritable x2
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.capset(header, data) != 0:
        raise OSError(ctypes.get_errno(), "capset: the capabilities could not be dropped")


def _run_child(env: dict) -> int:
    """``python -S /lab/_minillm_child.py`` with ``env``, in this already-started interpreter."""
    os.environ.clear()
    os.environ.update(env)
    sys.dont_write_bytecode = True
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = ["/lab"] + paths + [p for p in sys.path if p not in paths and p != "/lab"]
    sys.argv = ["/lab/_minillm_child.py"]
    sys.stdin, sys.stdout, sys.stderr = (os.fdopen(0, "r"), os.fdopen(1, "w", buffering=1),
                                         os.fdopen(2, "w", buffering=1))
    try:
        runpy.run_path("/lab/_minillm_child.py", run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:           # noqa: BLE001 - as a fresh interpreter would report it
        traceback.print_exc()
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:          # noqa: BLE001
            pass
    return code
