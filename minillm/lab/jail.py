"""Where the student's process runs: a view of the machine holding only what it needs.

``isolation()`` says whether this machine can isolate (Linux, the ``unshare`` tool, and namespaces
the kernel lets this user create: a container may forbid them) and, if not, why.
``command(spec)`` is the command line that starts a program isolated: ``unshare`` gives it fresh
mount, PID, network, IPC and UTS namespaces (and, for a grader not running as root, a user
namespace), then runs this file as a script — before any student code — to build its world:

- a root of its own (a small ``tmpfs``, then ``pivot_root``: the old root is gone, not merely out
  of reach) holding the system's ``/usr``, ``/etc`` and libraries, the Python environment and the
  student's tree, all read-only; a private ``/tmp`` and ``/dev/shm`` of bounded size; a few
  devices; a fresh ``/proc`` that shows its own processes only. The teacher's repository (its
  ``.git`` too), the graders and the grading's files are not in it;
- no network but a loopback of its own (the ranks of exercises 10 and 11 talk over 127.0.0.1);
- this script stays as the namespace's PID 1: it starts the program, reaps what it leaves, and
  ends when the program ends, and the kernel then kills everything else in the namespace. It is
  killed with the ``unshare`` process (``--kill-child``), itself killed when the grader ends;
- the program runs as ``nobody`` (uid 65534) when the grader is root, else with no capability
  left; ``no_new_privs``; limits on CPU time, memory, processes, open files and file size.

Elsewhere (macOS, Windows, a container without namespaces) the student's process runs as a plain
process of the grader's user, and every grading says ``isolated: no`` (``grade --class`` refuses
unless the teacher accepts it). ``MINILLM_LAB_ISOLATION=off`` forces that fallback (tests do).
This file imports only the standard library: it runs before the jail holds anything else.
"""
import ctypes
import ctypes.util
import functools
import json
import os
import platform
import resource
import shutil
import signal
import subprocess
import sys

NOBODY = 65534
ENV = "MINILLM_LAB_ISOLATION"          # "off": never isolate
# Limits of the student's process (each overridable: MINILLM_LAB_LIMIT_<NAME>)
LIMITS = {"cpu_s": 3600, "memory_mb": 16384, "processes": 512, "files": 2048, "file_mb": 256,
          "tmp_mb": 512}
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
DEVICES = ("null", "zero", "full", "random", "urandom")
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = (
    1, 2, 4, 8, 32, 4096, 16384, 1 << 18)
ST_LOCKED = {1: MS_RDONLY, 2: MS_NOSUID, 4: MS_NODEV, 8: MS_NOEXEC, 1024: 1 << 10, 2048: 1 << 11}


def limits() -> dict:
    return {k: int(os.environ.get(f"MINILLM_LAB_LIMIT_{k.upper()}", v)) for k, v in LIMITS.items()}


def command(spec: dict) -> list[str]:
    """The command that runs ``spec["argv"]`` isolated (see the module docstring); the spec is
    written next to the jail's mount point (outside the jail: gone once it is built)."""
    path = os.path.join(os.path.dirname(spec["root"]), "jail.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(spec, f)
    flags = ["--mount", "--pid", "--fork", "--net", "--ipc", "--uts", "--kill-child"]
    if os.geteuid() != 0:
        flags[:0] = ["--user", "--map-root-user"]
    return [shutil.which("unshare") or "unshare", *flags, "--", python(), "-I", "-S",
            os.path.abspath(__file__), path]


def python() -> str:
    """This environment's interpreter by a path the jail holds. A venv reached through a link
    (``.venv -> /elsewhere``) is bound at its real place, and a venv's python must start from its
    own folder (it finds ``pyvenv.cfg`` there), so the folder is resolved, never the binary."""
    inside = os.path.relpath(sys.executable, sys.prefix)
    if inside.startswith(".."):
        return sys.executable
    return os.path.join(os.path.realpath(sys.prefix), inside)


def isolation() -> tuple[bool, str]:
    """(whether the student's process can be isolated here, and if not, why)."""
    if os.environ.get(ENV, "").lower() in ("off", "0", "no"):
        return False, f"turned off ({ENV}={os.environ[ENV]})"
    return _probe()


@functools.lru_cache(maxsize=1)
def _probe() -> tuple[bool, str]:
    if not sys.platform.startswith("linux"):
        return False, f"no namespaces on {sys.platform}"
    if shutil.which("unshare") is None:
        return False, "no `unshare` tool (util-linux)"
    import tempfile
    with tempfile.TemporaryDirectory(prefix="minillm-jail-probe-") as tmp:
        for d in ("root", "tree"):
            os.mkdir(os.path.join(tmp, d))
        spec = plan(os.path.join(tmp, "root"), os.path.join(tmp, "tree"), ["/bin/true"], {})
        try:
            done = subprocess.run(command(spec), capture_output=True, text=True, timeout=60,
                                  stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as e:
            return False, f"the namespaces could not be set up ({e})"
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        return False, f"the namespaces could not be set up: {why}"
    return True, "namespaces (mount, PID, network, IPC" + (", user)" if os.geteuid() else ")")


def _python_dirs() -> list[str]:
    import sysconfig
    dirs = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
            os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))}
    dirs |= {p for k, p in sysconfig.get_paths().items() if k != "scripts" and p}
    dirs |= {os.path.realpath(d) for d in dirs}
    return sorted(d for d in dirs if os.path.isdir(d))


def plan(root: str, tree: str, argv: list[str], env: dict, hidden: tuple[str, ...] = (),
         cwd: str = "/lab", uid: int | None = None,
         shared: list[tuple[str, str]] | tuple = ()) -> dict:
    """What the jail holds: ``root`` (an empty folder: its mount point), ``tree`` read-only at
    ``/lab``, the system and the Python environment read-only, each (folder, where) of
    ``shared`` read-only (the compiled kernels: ``shared_kernels.py``); ``hidden`` (the
    teacher's repository) covered by an empty folder wherever a bound folder holds it."""
    binds, links = [], []
    for d in SYSTEM:
        if os.path.islink(d):
            links.append((os.readlink(d), d))
        elif os.path.isdir(d):
            binds.append((d, d))
    covered = [d for _, d in binds]
    for d in _python_dirs():
        if not any(d == c or d.startswith(c.rstrip("/") + "/") for c in covered):
            binds.append((d, d))
            covered.append(d)
    binds.append((tree, "/lab"))
    binds.extend(shared)
    hide = [h for h in hidden if any(h.startswith(s.rstrip("/") + "/") or h == s
                                     for s, _ in binds)]
    lim = limits()
    return {"root": root, "binds": binds, "links": links, "hide": hide, "argv": argv, "env": env,
            "cwd": cwd,
            "uid": (NOBODY if os.geteuid() == 0 else None) if uid is None else uid,
            "tmp_mb": lim["tmp_mb"], "limits": lim}


def kill_marked(mark: str, exact: bool = True) -> int:
    """SIGKILL every process (of those this user may see) whose environment holds ``mark``
    (``MINILLM_LAB_RUN=...``; a variable that starts with it if not ``exact``): what a student's
    process left behind, a detached one too. Linux only (elsewhere 0); how many were killed."""
    killed, needle = 0, b"\0" + mark.encode() + (b"\0" if exact else b"")
    for _ in range(20):                       # a process may fork while we look: look again
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc") if os.path.isdir("/proc") else []):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if needle in b"\0" + f.read() + b"\0" and int(pid) != os.getpid():
                        found.append(int(pid))
            except OSError:
                continue
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except OSError:
                pass
        if not found:
            break
    return killed


def preexec(isolated: bool):
    """In the new process, before it runs anything: it dies with the grader (PR_SET_PDEATHSIG),
    and, without a jail, takes the jail's limits itself."""
    def setup():
        if sys.platform.startswith("linux"):
            import ctypes
            ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL, 0, 0, 0)
        if not isolated:
            set_limits(limits())
    return setup


def kill_tree(proc: subprocess.Popen, isolated: bool) -> None:
    """Kill ``proc`` and all it started: the jail's namespace dies with the ``unshare`` process;
    without one, the process group (``kill_marked`` then finds those that left it)."""
    try:
        if isolated or not hasattr(os, "killpg"):
            proc.kill()
        else:
            os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass


# ---- inside the namespaces (this file run as a script, as PID 1) ------------------------------
_libc = None


def _c(name: str, *args) -> int:
    global _libc
    _libc = _libc or ctypes.CDLL("libc.so.6" if sys.platform.startswith("linux") else
                                ctypes.util.find_library("c"), use_errno=True)
    rc = getattr(_libc, name)(*args)
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}{args!r}: {os.strerror(err)}")
    return rc


def _mount(src, dst, fstype, flags, data=None) -> None:
    enc = lambda s: s.encode() if isinstance(s, str) else s    # noqa: E731
    _c("mount", enc(src), enc(dst), enc(fstype), ctypes.c_ulong(flags), enc(data))


def _bind(src: str, dst: str, readonly: bool = True) -> None:
    if os.path.isdir(src):
        os.makedirs(dst, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        open(dst, "a").close()
    _mount(src, dst, None, MS_BIND | MS_REC)
    if readonly:                           # the flags the kernel locked must be kept (user ns)
        locked = sum(v for k, v in ST_LOCKED.items() if os.statvfs(dst).f_flag & k)
        _mount(None, dst, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | locked)


def _loopback_up() -> None:
    import fcntl
    import socket
    import struct
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifreq = struct.pack("16sH22x", b"lo", 0)
        flags = struct.unpack("16sH22x", fcntl.ioctl(s, 0x8913, ifreq))[1]    # SIOCGIFFLAGS
        fcntl.ioctl(s, 0x8914, struct.pack("16sH22x", b"lo", flags | 1))     # IFF_UP


def build(spec: dict) -> None:
    """Mount the jail's world and make it the root (see the module docstring)."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    root = spec["root"]
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=16m,mode=755")
    inside = lambda p: os.path.join(root, p.lstrip("/"))          # noqa: E731
    for target, link in spec["links"]:
        os.symlink(target, inside(link))
    for src, dst in sorted(spec["binds"], key=lambda b: b[1]):
        _bind(src, inside(dst))
        for h in spec["hide"]:
            if h.startswith(src.rstrip("/") + "/") and os.path.isdir(h):
                _mount("tmpfs", inside(dst + h[len(src):]), "tmpfs", MS_RDONLY, "size=4k")
    for d in DEVICES:
        _bind(f"/dev/{d}", inside(f"/dev/{d}"), readonly=False)
    for name, fd in (("stdin", 0), ("stdout", 1), ("stderr", 2)):
        os.symlink(f"/proc/self/fd/{fd}", inside(f"/dev/{name}"))
    os.symlink("/proc/self/fd", inside("/dev/fd"))
    for d in ("/tmp", "/dev/shm"):
        os.makedirs(inside(d), exist_ok=True)
        _mount("tmpfs", inside(d), "tmpfs", MS_NOSUID | MS_NODEV,
               f"size={spec['tmp_mb']}m,mode=1777")
    os.makedirs(inside("/proc"), exist_ok=True)
    _mount("proc", inside("/proc"), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _loopback_up()
    os.chdir(root)
    if platform.machine() in PIVOT_ROOT:
        _c("syscall", ctypes.c_long(PIVOT_ROOT[platform.machine()]), b".", b".")
        _c("umount2", b".", 2)                                       # MNT_DETACH
    else:
        os.chroot(".")
    os.chdir("/")
    _mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def confine(spec: dict) -> None:
    """In the program's process, just before it starts: limits, then no privilege left."""
    set_limits(spec["limits"])
    _c("prctl", 38, ctypes.c_ulong(1), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))
    uid = spec["uid"]
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    else:                       # root of a user namespace: no capability survives the exec
        for cap in range(64):
            try:
                _c("prctl", 24, ctypes.c_ulong(cap), ctypes.c_ulong(0), ctypes.c_ulong(0),
                   ctypes.c_ulong(0))                                # PR_CAPBSET_DROP
            except OSError:
                break


def set_limits(lim: dict) -> None:
    """The resource limits of the student's process (also used without a jail)."""
    wanted = {resource.RLIMIT_CPU: lim["cpu_s"], resource.RLIMIT_AS: lim["memory_mb"] << 20,
              resource.RLIMIT_NOFILE: lim["files"], resource.RLIMIT_FSIZE: lim["file_mb"] << 20,
              resource.RLIMIT_CORE: 0}
    if hasattr(resource, "RLIMIT_NPROC") and os.geteuid() == 0:
        wanted[resource.RLIMIT_NPROC] = lim["processes"]   # counted per user: nobody's only
    for what, value in wanted.items():
        soft, hard = resource.getrlimit(what)
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        try:
            resource.setrlimit(what, (value, value))
        except (ValueError, OSError):
            pass


def main(spec: dict) -> int:
    build(spec)
    pid = os.fork()
    if pid == 0:
        try:
            confine(spec)
            os.chdir(spec["cwd"])
            os.execve(spec["argv"][0], spec["argv"], spec["env"])
        except BaseException as e:       # noqa: BLE001 - the jail could not start it
            os.write(2, f"minillm lab jail: {e}\n".encode())
        os._exit(127)
    return reap(pid)


def reap(pid: int) -> int:
    """PID 1's life once it started the program ``pid``: reap everything, end with the program
    (its exit code, or 128 + the signal that killed it)."""
    devnull = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):                 # the program's pipes end with it, not with PID 1
        os.dup2(devnull, fd)
    while True:
        try:
            done, status = os.wait()
        except ChildProcessError:
            return 0
        if done == pid:
            return exit_code(status)


def exit_code(status: int) -> int:
    return os.waitstatus_to_exitcode(status) % 256 if os.WIFEXITED(status) else \
        128 + os.WTERMSIG(status)


if __name__ == "__main__":
    with open(sys.argv[1], encoding="utf-8") as spec_file:
        _spec = json.load(spec_file)
    if _spec.get("zygote"):      # the students' zygote (_zygote.py), read before the teacher's
        import runpy             # folder is out of sight, then run as this jail's PID 1
        _serve = runpy.run_path(os.path.join(os.path.dirname(__file__), "_zygote.py"))["serve"]
        build(_spec)
        sys.exit(_serve(_spec, sys.modules[__name__]))
    sys.exit(main(_spec))
