"""What the pipeline's ranks 1..P-1 run (notebook 07): spawned by ``dist.launcher.launch`` on
one machine, or started by torchrun (``torchrun_worker``, the registry's ``EngineSpec.worker``),
each learns its layers and the KV layout from rank 0, builds its stage and serves micro-batches.
"""
from __future__ import annotations

import sys

from ...core.model import PagedLlama
from ...dist.comm import Comm, WorkerError, group_from_env
from ...dist.launcher import torchrun_device
from .stage import StageConfig, StageRunner, serve


def run_worker(comm: Comm, net: PagedLlama) -> None:
    """Ranks 1..P-1: learn the KV layout from rank 0, build this stage, serve micro-batches."""
    from .. import get_attention_backend

    config: StageConfig = comm.recv_object(0, what=None)
    backend = get_attention_backend(config.attention_backend, comm.device, net.embed.dtype)
    runner = StageRunner(net, comm.rank, config, backend, comm.device, net.embed.dtype)
    serve(comm, runner)
    comm.close()


def torchrun_worker(model_name: str, pipeline_timeout_s: float = 60.0,
                    dtype: str | None = None, **rank0_options) -> int:
    """What ``python -m minillm generate --pipeline-parallel N`` runs on ranks 1..N-1 under
    torchrun (the registry's ``EngineSpec.worker``, given the engine options): load the same
    model, join the group, serve until rank 0 says "stop". The other options are rank 0's: it
    sends each stage what it needs."""
    from ...models import load_model

    from ...layers.linear import get_linear_kernel

    device = torchrun_device()
    model = load_model(model_name, device, dtype)     # rank 0's --dtype
    comm = group_from_env(device, pipeline_timeout_s)
    kernel = get_linear_kernel(rank0_options.get("linear_backend"), device, model.dtype)
    try:
        run_worker(comm, PagedLlama(model.hf_model, kernel))
    except WorkerError as e:
        print(f"[minillm pipeline] {e}", file=sys.stderr)
        return 1
    return 0
