"""Rung 14: the step without Python in it -- a compiled decode step and int8 weights
(notebook 14_compiled).

``config.py`` holds the options (``compile``, ``compile_buckets``; ``quantization`` is the
layers' own, ``layers/quant.py``), ``ops.py`` the paged attention as one custom op that reads
the KV pool from the step's context (so the graph does not break around it), ``graph.py`` the
decode forward as one module of plain tensor ops, ``runner.py`` the ``CompiledRunner`` (decode
steps padded to a bucket and run compiled; prefill and mixed steps eager) and ``engine.py`` rung
3's engine with that runner (``make_runner``).
"""
from .config import CompileConfig, bucket_for

__all__ = ["CompileConfig", "bucket_for"]
