"""Rung 8 — scheduling policies (notebook 08): ``priority`` and ``score`` (``policy.py``), given
to the paged engine as its ``SchedulingPolicy`` (``core/policy.py``) by ``PolicyConfig``
(``config.py``: the ``policy`` option and the weights)."""
