"""How many bytes tensor and pipeline parallelism move per token, and what that costs on a link
(notebook 10).

Tensor parallelism sums two ``[tokens, hidden]`` tensors per layer across T ranks. A ring
all-reduce (NCCL's, and gloo's for large tensors) sends 2 (T - 1) / T of the tensor out of every
rank. Pipeline parallelism sends one ``[tokens, hidden]`` tensor across each of the P - 1 stage
boundaries -- and, in this engine, the logits of the sampled rows from the last stage back to
rank 0 (vocabulary x 4 bytes each: on SmolLM2 more than the hidden states of all its layers).

The cost on a link is the alpha-beta model: a message of b bytes takes alpha + b / beta, alpha
the latency of one message and beta the bandwidth. TP pays 2 x layers latencies per step -- it is
latency-bound at small batches -- PP pays P - 1.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta


def tp_bytes_per_token(hidden: int, layers: int, tensor: int, elem_bytes: int = 4) -> float:
    """Bytes one rank sends per token: 2 all-reduces per layer, 2 (T - 1) / T of each."""
    return 2 * layers * hidden * elem_bytes * 2 * (tensor - 1) / tensor


def pp_bytes_per_token(hidden: int, pipeline: int, vocab: int = 0, elem_bytes: int = 4) -> float:
    """Bytes sent per token across all stage boundaries (+ its logits back when ``vocab``)."""
    return (pipeline - 1) * hidden * elem_bytes + (vocab * 4 if pipeline > 1 else 0)


@dataclass(frozen=True)
class Link:
    name: str
    alpha_s: float        # latency of one message
    beta_bytes_s: float   # bandwidth

    def seconds(self, nbytes: float, messages: int = 1) -> float:
        return messages * self.alpha_s + nbytes / self.beta_bytes_s


def comm_seconds_per_step(link: Link, tokens: int, hidden: int, layers: int, tensor: int = 1,
                          pipeline: int = 1, elem_bytes: int = 4) -> float:
    """Communication time of one step of ``tokens`` tokens (all-reduces, or stage messages)."""
    if tensor > 1:
        per = tokens * hidden * elem_bytes * 2 * (tensor - 1) / tensor
        return 2 * layers * link.seconds(per)
    return (pipeline - 1) * link.seconds(tokens * hidden * elem_bytes)


# --- measuring this machine's all-reduce: T processes, one tensor size at a time ------------------
def _bench_rank(rank: int, world: int, port: int, sizes: list[int], repeats: int, out) -> None:
    import torch
    import torch.distributed as dist

    from ...dist.comm import Comm
    from .shard import AllReduce

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=120))
    pg = dist.ProcessGroupGloo(store, rank, world, timedelta(seconds=120))
    comm = Comm(pg, rank, world, torch.device("cpu"), 120.0)
    result = {}
    for how in ("collective", "exchange"):       # the engine's own AllReduce, both ways
        reduce = AllReduce(how)
        reduce.connect(comm, range(world), pg)
        for n in sizes:
            x = torch.ones(n)
            for _ in range(3):
                reduce(x)
            t = time.perf_counter()
            for _ in range(repeats):
                reduce(x)
            result[how, n] = (time.perf_counter() - t) / repeats
            comm.prune()
    comm.flush()
    if rank == 0:
        out.put(result)
    pg.allreduce([torch.ones(1)]).wait()     # nobody leaves before rank 0 has read its result


def measure_all_reduce(world: int, sizes: list[int], repeats: int = 50) -> dict:
    """Seconds per all-reduce of ``n`` fp32 numbers among ``world`` fresh processes on this
    machine (no model running: the link alone), ``{(how, n): seconds}`` for ``how`` in
    collective (gloo's all-reduce) and exchange (``AllReduce``'s point-to-point sum)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_bench_rank, args=(r, world, port, sizes, repeats, out),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    try:
        return out.get(timeout=300)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def fit_link(name: str, world: int, timings: dict[int, float], elem_bytes: int = 4) -> Link:
    """alpha and beta from a least-squares line through (bytes sent per rank, seconds);
    ``timings``: {numbers all-reduced: seconds}."""
    xs = [n * elem_bytes * 2 * (world - 1) / world for n in timings]
    ys = list(timings.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return Link(name, max(my - slope * mx, 0.0), 1.0 / slope if slope > 0 else float("inf"))


# Nominal links for the model (vendors' one-direction bandwidths; latencies typical of NCCL's
# small-message all-reduce): inputs to a what-if, not measurements of this machine.
NOMINAL_LINKS = (Link("NVLink 4 (H100), nominal", 5e-6, 450e9),
                 Link("PCIe 4.0 x16, nominal", 10e-6, 25e9),
                 Link("25 GbE between machines, nominal", 30e-6, 3.1e9))
