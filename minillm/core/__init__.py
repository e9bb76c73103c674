"""The core: the paged engine every rung from 3 on is built from (rung 3, notebook 03).

Read it in the order a request travels through one engine step (``engine.py``'s loop):

    request -> scheduler.py (token budget, admission, preemption; policy.py: who goes first,
               budget.py: how many tokens a step may hold)
            -> allocator.py / block_manager.py (KV slots in blocks: share, copy on write, cache)
            -> executor.py (where the forward runs, how many steps are in flight)
            -> runner.py + model.py (one batched forward over the KV pool, kv_pool.py)
            -> sampler.py (+ beam.py) -> commit.py's update_from_output (the one commit point)

``sequence.py`` holds a request's samples; ``idle.py`` says when a step that schedules nothing is
a bug; ``config.py`` holds the pool's and the step's limits. The kernels the model runs on are in
``minillm/layers`` (attention backends, linear, fused ops, KV slot formats), what every engine
shares in ``minillm/runtime``. Later rungs (``minillm/engines/r5_*`` to ``r13_*``) plug in
components (an allocator, a policy, a batch controller, an executor) or override the engine's
seams (``make_runner``, ``propose``/``verify``, ``schedule_step``); they do not copy them.
"""
