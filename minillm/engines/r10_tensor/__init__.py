"""Rung 10 — tensor parallelism (notebook 10): every layer split across T ranks.

Megatron's split, as vLLM, SGLang and nano-vllm run it inside one machine: the q/k/v and gate/up
projections are *column-parallel* (each rank computes its own heads and its own slice of the MLP's
intermediate units, no communication), o and down are *row-parallel* (each rank multiplies its
slice and one all-reduce sums the slices), so a layer costs two all-reduces of ``[tokens, hidden]``
and each rank's KV pool holds its heads of every token. ``shard.py`` is the split itself;
``runner.py`` is one rank and ``engine.py`` the distributed runtime (ranks on torch.distributed,
rank 0's scheduler).
"""
