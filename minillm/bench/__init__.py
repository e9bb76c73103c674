"""Measuring the engine, apart from the engine: nothing here serves a request.

- ``offline.py`` -- ``python -m minillm bench``: every engine and peer on one workload, the
  step-3 experiments (``kv.py``: rung 9's capacity per KV format);
- ``loadgen.py`` (+ ``compare.py``, ``mixed.py``) -- ``python -m minillm bench --serve``: a load
  generator against running servers, ours and vLLM's, side by side, and request classes with
  objectives;
- ``profile_step.py`` (``make profile``), ``kernels.py`` (rung 4's kernels), ``kv_accuracy.py``
  and ``dtype_accuracy.py`` (what a narrower cache or dtype costs), ``peers.py`` and
  ``vllm_peer.py`` (Hugging Face's and vLLM's engines as peers).
"""
