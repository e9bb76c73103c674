"""The core: the paged engine every rung from 3 on is built from (rung 3, notebook 03).

Read it in the order a request travels through one engine step:

    request -> scheduler.py (token budget, admission, preemption)
            -> allocator.py / block_manager.py (KV slots in blocks: share, copy on write, cache)
            -> runner.py + model.py + attention/ (one batched forward over the KV pool,
               kv_pool.py: the K/V tensors, kv_quant.py: how wide a slot is)
            -> sampler.py (+ beam.py) -> scheduler.postprocess (tokens committed, stops checked)

``engine.py`` is that step (``PagedEngine``); ``sequence.py`` holds a request's samples.
``attention/`` holds the backends: the torch reference (rung 3) and the kernels (rung 4: C++ on
the CPU, Triton on the GPU). Later rungs (``minillm/engines/r5_*`` to ``r7_*``) compose and
extend these pieces; they do not copy them. Rungs 8 and 9 are seams of the core itself:
``policy.py`` (who goes first) and ``kv_quant.py`` (a narrower KV slot, ``kv_cache_dtype``).
"""
