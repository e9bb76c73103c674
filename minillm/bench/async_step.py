"""Step time with and without ``async_scheduling`` (rung 12, notebook 12).

    python -m minillm.bench.async_step --models tiny-llama,smollm2-135m-instruct --batch 1,8,32

Each run serves ``batch`` requests at once (``max_num_seqs = batch``, fixed output lengths)
through the one driver, with a consumer that does what a server's stream does after every step:
decode each running request's text so far. Synchronously that host work sits between two
forwards; with ``async_scheduling`` the next forward runs during it. Printed per model and batch:
ms per step and output tok/s for both, the compute's idle time between two forwards (sync/async:
the bubble, from the ``"executed"`` observer event's spans) and the host time the overlap hid
(``overlap``). ``--busy N`` runs both beside N processes spinning on the CPU, as a lab server's
other jobs would (``minillm.openmp``: what a busy machine does to OpenMP's waiting threads).
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from ..runtime.driver import Driver, ScheduledArrivals, WallClock
from ..engines import create_engine
from ..models import load_model
from .profile_step import busy_cores
from ..request import Request, SamplingParams


def requests(batch: int, prompt_len: int, max_tokens: int) -> list[Request]:
    return [Request([(13 * i + k) % 500 + 10 for k in range(prompt_len)],
                    SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for i in range(batch)]


def measure(model, batch: int, async_scheduling: bool, prompt_len: int, max_tokens: int) -> dict:
    """One run: ms per step, output tok/s, the overlap's account (``overlap``), and a timeline in
    ms from the first forward's start: ``forwards`` (the ``"executed"`` observer event, on the
    worker thread when overlapped) and ``host`` (the consumer's detokenizing after each step, on
    the caller's); ``idle_ms``: the time between forwards, the compute's bubble (notebook 12)."""
    engine = create_engine("paged", model, async_scheduling=async_scheduling,
                           max_num_seqs=batch, max_num_batched_tokens=max(512, batch))
    tok, forwards, host = model.tokenizer, [], []
    reqs = requests(batch, prompt_len, max_tokens)

    def stream(out, record):            # what a server's streaming does after each step
        t = time.perf_counter()
        for r in reqs:
            tok.decode(r.output_token_ids)
        host.append((t, time.perf_counter()))

    engine.run(requests(batch, prompt_len, 4))          # warm-up: kernels, allocator
    engine.observers.add(lambda e: forwards.append(e.data), ("executed",))
    driver = Driver(engine, WallClock(), ScheduledArrivals([(0.0, r) for r in reqs]),
                    on_step=stream)
    t = time.perf_counter()
    result = driver.run()
    seconds = time.perf_counter() - t
    info = engine.describe().get("overlap")
    engine.close()
    t0 = forwards[0][0]
    ms = lambda spans: [((a - t0) * 1e3, (b - t0) * 1e3) for a, b in spans]  # noqa: E731
    return {"ms_per_step": 1000 * seconds / len(result.steps),
            "tok_s": batch * max_tokens / seconds, "overlap": info,
            "forwards": ms(forwards), "host": ms(host),
            "idle_ms": 1e3 * sum(b[0] - a[1] for a, b in zip(forwards, forwards[1:]))}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny-llama,smollm2-135m-instruct")
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (on a loaded 2-core machine, 2 threads' OpenMP barriers "
                         "slow the main thread's forwards far more than a worker thread's: "
                         "compare at 1 to see the overlap alone)")
    ap.add_argument("--busy", type=int, default=0,
                    help="keep this many cores busy with other processes while measuring (a "
                         "lab server's other jobs; minillm.openmp says what they do to OpenMP)")
    args = ap.parse_args(argv)
    with busy_cores(args.busy):
        run(args)


def run(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"{torch.get_num_threads()} thread(s), {args.busy} core(s) busy, GOMP_SPINCOUNT="
          f"{os.environ.get('GOMP_SPINCOUNT', '-')}, OMP_WAIT_POLICY="
          f"{os.environ.get('OMP_WAIT_POLICY', '-')}")
    print(f"{'model':24} {'batch':>5} {'sync ms/step':>12} {'async ms/step':>13} "
          f"{'sync tok/s':>10} {'async tok/s':>11} {'idle ms/step':>13}  hidden host ms")
    for name in args.models.split(","):
        model = load_model(name, dtype=args.dtype)
        for batch in map(int, args.batch.split(",")):
            s = measure(model, batch, False, args.prompt_len, args.max_tokens)
            a = measure(model, batch, True, args.prompt_len, args.max_tokens)
            idle = [m["idle_ms"] / max(1, len(m["forwards"]) - 1) for m in (s, a)]
            print(f"{name:24} {batch:5d} {s['ms_per_step']:12.2f} {a['ms_per_step']:13.2f} "
                  f"{s['tok_s']:10.1f} {a['tok_s']:11.1f} {idle[0]:6.2f}/{idle[1]:<6.2f}  "
                  f"{a['overlap']['hidden_ms']:.1f} of {a['overlap']['forward_ms']:.1f} "
                  "forward ms")


if __name__ == "__main__":
    main()
