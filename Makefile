VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
WORLD_SIZE ?= 4
ZERO ?= 3
OPTIMIZERS ?=

.PHONY: setup test test-fast lint demo bench aot gpu-check clean

$(PY):
	python3 -m venv $(VENV)

$(STAMP): $(PY) requirements-dev.txt pyproject.toml
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

setup: $(STAMP)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: setup lint
	$(PY) -m pytest -q tests

# the inner loop: everything but the tests marked slow (3 to 5 minutes on 2 cores)
test-fast: setup lint
	$(PY) -m pytest -q -m "not slow" tests

demo: setup
	$(PY) -m vescale_optim.demo --world-size $(WORLD_SIZE) --zero $(ZERO) $(if $(OPTIMIZERS),--optimizers $(OPTIMIZERS))

bench: setup
	$(PY) benchmarks/padding.py
	$(PY) benchmarks/collectives.py
	$(PY) benchmarks/fsdp.py
	$(PY) benchmarks/costs.py
	$(PY) benchmarks/kernels.py
	$(PY) benchmarks/checkpoint.py
	$(PY) benchmarks/qcomm.py
	$(PY) benchmarks/scale.py

aot: setup
	env -u TRITON_INTERPRET $(PY) -m vescale_optim.kernels.aot --out build/aot

# The one-GPU validation; no set-up (a lent GPU machine is offline: $$PYTHON, .venv or python3
# is used as it is). GPU_CHECK=--cpu rehearses it on CPU, GPU_CHECK=--dry-run lists the stages.
gpu-check:
	bash benchmarks/gpu_check.sh $(GPU_CHECK)

clean:
	rm -rf $(VENV) build *.egg-info
