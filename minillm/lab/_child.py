"""The student's process (``sandbox.Student`` starts a copy of this script in the student's tree).

It imports the student's modules, says ``("ready",)``, then reads requests from stdin — (grader
file, probe name, args, kwargs), pickled by the teacher's process — calls the probe, and writes
back ``("ok", value)`` or ``("raised", type, message, traceback)`` with ``torch.save`` on a private
copy of stdout: fd 1 itself is pointed at stderr first, so whatever the student's code prints ends
up in the log, not in the answers. Nothing here decides anything: the teacher's process reads the
values (``torch.load(weights_only=True)``) and judges.
"""
import importlib.util
import io
import os
import pickle
import struct
import sys
import traceback


def load(path: str, cache: dict):
    if path not in cache:
        name = "_minillm_probes_" + os.path.basename(path).removesuffix(".py")
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        cache[path] = module
    return cache[path]


def answer(path: str, name: str, args, kwargs, cache: dict) -> tuple:
    try:
        return ("ok", getattr(load(path, cache), name)(*args, **kwargs))
    except BaseException as e:      # noqa: BLE001 - SystemExit too: a refusal to answer
        return ("raised", type(e).__name__, str(e)[:2000], traceback.format_exc(limit=-4)[-3000:])


def main() -> int:
    channel = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)              # prints of the student's code go to the log
    sys.stdout = sys.stderr
    requests = sys.stdin.buffer
    import torch
    # two threads whatever the machine has, or OMP_NUM_THREADS where it is set: `make test`'s
    # workers share two cores, one thread each, and a grading's teams of two spun on each
    # other's cores (exercise 03's reference grading: 9.3 s of CPU, 8.6 s with one thread each)
    n = os.environ.get("OMP_NUM_THREADS", "")
    torch.set_num_threads(int(n) if n.isdigit() and int(n) > 0 else 2)
    # The student's modules first: a file that ends this process at import ends it here, before
    # the "ready" frame, and the teacher's side then knows not to start it again for every call.
    # One that raises is reported by the first call that imports it, with its traceback.
    for module in filter(None, os.environ.get("MINILLM_LAB_MODULES", "").split(",")):
        try:
            importlib.import_module(module)
        except BaseException:     # noqa: BLE001 - SystemExit too; the call reports it
            sys.modules.pop(module, None)
    send(channel, ("ready",))
    cache: dict = {}
    while True:
        head = requests.read(8)
        if len(head) < 8:
            return 0
        (n,) = struct.unpack("<Q", head)
        path, name, args, kwargs = pickle.loads(requests.read(n))
        send(channel, answer(path, name, args, kwargs, cache))


def send(channel, msg: tuple) -> None:
    """One frame: 8 bytes of length, then ``msg`` as ``torch.save`` writes it."""
    import torch
    buf = io.BytesIO()
    try:
        torch.save(msg, buf)
    except Exception as e:      # noqa: BLE001 - an answer that is not plain data
        buf = io.BytesIO()
        torch.save(("raised", "TypeError", f"the answer cannot be sent back: {e}"), buf)
    data = buf.getvalue()
    channel.write(struct.pack("<Q", len(data)) + data)


if __name__ == "__main__":
    sys.exit(main())
