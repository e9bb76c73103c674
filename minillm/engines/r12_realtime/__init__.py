"""Rung 12 — the scheduler in real time (notebook 12): the deadline policy ``slo`` (``slo.py``)
and the adaptive batch (``batch_controller.py``), components the core's scheduler takes, and the
``ThreadExecutor`` (``engine.py``: ``async_scheduling=True``), whose forwards run while the caller
handles the previous step's outputs; ``config.py`` holds their options, ``sim.py`` the classroom
simulator."""
