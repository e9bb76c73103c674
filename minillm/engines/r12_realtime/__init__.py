"""Rung 12 — the scheduler in real time (notebook 12): an engine whose next forward runs while the
caller handles this step's outputs (``engine.AsyncEngine``, ``async_scheduling=True``), beside the
core's deadline policy ``slo`` (``core/policy.py``) and adaptive batch
(``core/batch_controller.py``), which every engine on the core gets as scheduler options."""
