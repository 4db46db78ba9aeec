# Two entry points: `make test` and `make demo`. Both create .venv when missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTHON ?= $(BIN)/python
BENCH_JSON ?= bench/results.json
BENCH_PNG ?= bench/results.png

.PHONY: test demo bench env clean

env: $(STAMP)

# Without a GPU, torch==2.13.0 is the CPU build (a local wheel on our machines):
# never let a CPU machine pull a multi-GB CUDA build. triton 3.6 runs the
# kernels under TRITON_INTERPRET=1 there and needs numpy<2.4 for it. The CuTe
# DSL (the `cute` extra) compiles the SM90 and SM100 kernels ahead of time without a GPU.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	if ! $(BIN)/python -c "import torch" 2>/dev/null; then \
	  if nvidia-smi -L >/dev/null 2>&1; then $(BIN)/pip install torch; \
	  else $(BIN)/pip install torch==2.13.0; fi; \
	fi
	$(BIN)/pip install 'triton==3.6.0' 'numpy<2.4'
	$(BIN)/pip install -e '.[test,cute]'
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest tests -q -p no:cacheprovider

demo: $(STAMP)
	$(BIN)/python -m dsa.demo

# GPU only (on CPU every benchmark skips). Where torch and triton are already
# installed (the lent H200): `make bench PYTHON=python3`.
bench:
	$(PYTHON) -m pytest bench --benchmark-only --benchmark-json=$(BENCH_JSON) -rs -p no:cacheprovider
	test ! -s $(BENCH_JSON) || $(PYTHON) -m bench.plot $(BENCH_JSON) -o $(BENCH_PNG)

clean:
	rm -rf $(VENV) build *.egg-info
