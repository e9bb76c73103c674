"""Where Triton runs its kernels: compiled on CUDA, in its CPU interpreter elsewhere."""
from __future__ import annotations

import os


def choose_triton_mode() -> None:
    """Without CUDA, make Triton run its kernels in its CPU interpreter (unless the user chose).
    Triton decides when it is first imported, and transformers imports it early (in
    ``load_model``), so ``minillm`` calls this on import, before that (triton/__init__.py too)."""
    import torch
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
