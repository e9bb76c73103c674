"""Rung 13's engine: one batch, many LoRA adapters (notebook 13_multi_lora).

Rung 3's engine through its seams; nothing of the step is written twice:

* ``make_runner`` returns a ``LoRARunner``: rung 3's runner whose model has every projection
  wrapped in a ``LoRALinear`` (the base product once for all rows, then each row's delta from its
  adapter's slot) and whose ``prepare`` tells the layers which slot each row of the step uses;
* ``schedule_step`` passes the scheduler an ``admit`` rule: a waiting request starts only once its
  adapter has a slot (``LoRASlots.acquire``: resident, free, or the least recently used one no
  running request needs); otherwise it waits, never fails, and the requests behind it may start.
  So that those cannot keep the slots busy forever, the oldest request waiting for a slot is
  skipped at most ``max_lora_skips`` steps: then no adapter request behind it starts until it has
  a slot (base-model requests hold no slot and still start);
* a request's ``cache_salt`` (``request.py``) starts its block hashes from its adapter, so the
  prefix cache never hands one adapter's K/V to another (the same prompt has different K/V).

Preemption, n > 1 and beam search need nothing more: a request's samples and beams share its
adapter. Speculative decoding with adapters is refused (``paged`` with both options is rung 6,
which takes no ``enable_lora``).
"""
from __future__ import annotations

import torch

from ...core.engine import PagedEngine
from ...core.runner import ModelRunner
from ...core.scheduler import Constraints, SchedulerOutput, SequenceGroup
from ...request import Request, RequestError
from .adapter import LoRAAdapter, LoRARequest, load_adapter
from .config import LoRAConfig
from .layers import LoRABatch, net_shapes, wrap_model
from .slots import LoRASlots


class LoRARunner(ModelRunner):
    """Rung 3's runner over a model whose layers add each row's adapter delta."""

    def __init__(self, model, num_blocks: int, block_size: int, backend, config: LoRAConfig,
                 **options):
        super().__init__(model, num_blocks, block_size, backend, **options)
        self.shapes = net_shapes(self.net)
        self.slots = LoRASlots(self.shapes, len(self.net.layers), config.max_loras,
                               config.max_lora_rank, self.device, model.dtype)
        if config.lora_kernel == "triton":     # where Triton cannot run: an error naming why, now
            from ...layers.attention.triton import TritonUnavailableError, require_triton
            try:
                require_triton()
            except TritonUnavailableError as e:
                raise ValueError(f"lora_kernel='triton' cannot run here: {e}") from None
        self.batch = LoRABatch(config.lora_kernel, self.slots)
        self.net = wrap_model(self.net, self.slots, self.batch)

    def prepare(self, scheduled):
        """Rung 3's layout, and each of its rows' slots for the layers (``LoRABatch``)."""
        ids, pos, meta, order, last = super().prepare(scheduled)
        slots = [self.slots.slot_of(adapter_name(s.request)) for s, n in order for _ in range(n)]
        self.batch.set_rows(torch.tensor(slots, dtype=torch.long, device=self.device))
        return ids, pos, meta, order, last


def adapter_name(request: Request) -> str | None:
    lora = request.lora_request
    return None if lora is None else lora.lora_name


class LoRAEngine(PagedEngine):
    name = "paged+lora"
    supports_lora = True
    configs = PagedEngine.configs + (LoRAConfig,)

    def __init__(self, model, **options):
        super().__init__(model, **options)
        # adapters read so far (host memory), by name: (its request, its weights)
        self.adapters: dict[str, tuple[LoRARequest, LoRAAdapter]] = {}
        # the oldest request refused a slot: in how many steps, and the latest of them
        self.starving: SequenceGroup | None = None
        self.skips = self.refused_at = 0

    def make_runner(self, num_blocks: int, block_size: int, backend) -> LoRARunner:
        return LoRARunner(self.model, num_blocks, block_size, backend, self.lora_config,
                          linear_kernel=self.linear_kernel(), kv_format=self.kv_format,
                          ops=self.layer_ops())

    # --- adapters -------------------------------------------------------------------------------
    def add_lora(self, lora: LoRARequest) -> LoRAAdapter:
        """Read ``lora``'s adapter into host memory (once per name; vLLM's ``add_lora``). A bad
        adapter, or a name already used for another path, is a ``ValueError`` naming it."""
        if not isinstance(lora, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora).__name__}")
        known = self.adapters.get(lora.lora_name)
        if known is not None:
            if known[0].lora_path != lora.lora_path:
                raise ValueError(f"adapter name {lora.lora_name!r} is already "
                                 f"{known[0].lora_path!r}, not {lora.lora_path!r}")
            return known[1]
        net = self.runner.net
        adapter = load_adapter(lora, self.runner.shapes, len(net.layers),
                               self.lora_config.max_lora_rank, self.model.dtype)
        self.adapters[lora.lora_name] = (lora, adapter)
        return adapter

    def list_loras(self) -> list[str]:
        return list(self.adapters)

    def validate(self, req: Request) -> None:
        super().validate(req)
        if req.lora_request is not None:
            try:
                self.add_lora(req.lora_request)
            except ValueError as e:
                raise RequestError(f"{req.request_id}: {e}") from None

    # --- the seams of rung 3's step -----------------------------------------------------------------
    def schedule_step(self) -> SchedulerOutput:
        return self.scheduler.schedule(Constraints(admit=self.admit))

    def admit(self, group: SequenceGroup) -> bool:
        """A waiting request may start once its adapter has a slot (the base model always has),
        unless it is behind ``starving``, the oldest request refused a slot, and that one has
        been skipped in ``max_lora_skips`` steps already. The scheduler asks in rank order, once a
        step each: ``starving`` was refused earlier in this step exactly when ``group`` is
        behind it."""
        name = adapter_name(group.request)
        if name is None:
            return True
        if self._held_back(group):
            return False
        busy = {adapter_name(g.request) for g in self.scheduler.running}
        if self.runner.slots.acquire(self.adapters[name][1], busy) is not None:
            if group is self.starving:
                self.starving = None
            return True
        if not self._waiting(self.starving):
            self.starving, self.skips = group, 0
        if group is self.starving:
            self.skips, self.refused_at = self.skips + 1, self.scheduler.num_steps
        return False

    def _held_back(self, group: SequenceGroup) -> bool:
        """``group`` is behind ``starving`` (refused earlier in this step), which was refused in
        more than ``max_lora_skips`` steps: it has been skipped enough."""
        return (self._waiting(self.starving) and group is not self.starving
                and self.skips > self.lora_config.max_lora_skips
                and self.refused_at == self.scheduler.num_steps)

    def _waiting(self, group: SequenceGroup | None) -> bool:
        """``group`` (the starving request, forgotten once admitted) still waits: an aborted one
        has left the scheduler."""
        return group is not None and self.scheduler.groups.get(group.request.request_id) is group

    # --- what views may ask ---------------------------------------------------------------------
    def describe(self) -> dict:
        slots = self.runner.slots
        return {**super().describe(), "max_loras": slots.num_slots,
                "max_lora_rank": slots.max_lora_rank, "lora_kernel": self.lora_config.lora_kernel,
                "lora_slots": slots.table(), "lora_loads": slots.loads,
                "lora_evictions": slots.evictions, "lora_slot_bytes": slots.nbytes}
