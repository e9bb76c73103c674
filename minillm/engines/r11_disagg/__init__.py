"""Rung 11 — prefill/decode disaggregation (notebook 11): a prefill worker and a
decode worker in separate processes, each with its own scheduler, block manager and KV pool, and
the prompt's KV blocks moved from one pool to the other over torch.distributed."""
