"""The kernels and numerics a model runs on, apart from any engine (rung 4, notebook 04):
``attention/`` (the backends: the torch reference, C++ on the CPU, Triton on the GPU),
``linear.py`` (the matrix-product kernel), ``fused.py`` (a layer's norm, RoPE and SiLU in one
pass each; ``csrc/``), ``kv_quant.py`` (how wide a KV slot is: rung 9) and ``config.py``
(``ModelConfig``: which of them runs)."""
