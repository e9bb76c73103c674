"""Rung 7: pipeline parallelism with dynamic batching, on torch.distributed (notebook 07)."""
