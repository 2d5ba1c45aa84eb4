# Two commands for a fresh machine: `make demo` and `make test` (each installs what it needs).
VENV       ?= .venv
PY         := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
ARGS       ?=
PYTEST_ARGS ?=
export TORCH_SPEC VENV
# The tests' OpenMP threads sleep instead of spinning when they wait: a shared 2-core machine stays usable. Not the
# demo's: its decoder's verify passes of 2+ tokens took 1.6-2.1x as long so (README, "OMP_WAIT_POLICY").
test test-unit test-integration test-slow: export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: setup demo test test-unit test-integration test-slow vllm-env lint bench clean

setup:
	@scripts/setup_env.sh

## Main job on the embedded default target (SmolLM2-135M-Instruct), offline: EAGLE-3 (9-min training budget),
## then Medusa (5 min; it reuses the EAGLE-3 run's answers, hidden states and plain/n-gram decodes).
demo: setup
	HF_HUB_OFFLINE=1 $(PY) train/run.py $(ARGS)
	HF_HUB_OFFLINE=1 $(PY) train/run.py head=medusa train.max_minutes=5 $(ARGS)

## Whole suite: unit (tiny random models), integration (default target), slow (DeepSpeed ranks, vLLM).
test: setup vllm-env
	HF_HUB_OFFLINE=1 $(PY) -m pytest $(PYTEST_ARGS)

test-unit: setup
	HF_HUB_OFFLINE=1 $(PY) -m pytest -m "not integration and not slow" $(PYTEST_ARGS)

test-integration: setup
	HF_HUB_OFFLINE=1 $(PY) -m pytest -m "integration and not slow" $(PYTEST_ARGS)

test-slow: setup vllm-env
	HF_HUB_OFFLINE=1 $(PY) -m pytest -m slow $(PYTEST_ARGS)

## Separate environment with the vLLM CPU engine, used to check exports (scripts/vllm_check.py).
vllm-env:
	@scripts/setup_vllm_env.sh

lint: setup
	$(VENV)/bin/ruff check .

## Benchmarks (extraction, training, decoding) on the default target; first the data and extract stages
## they read (skipped when done). ARGS: overrides for all, e.g. ARGS="model=tiny-llama" (a smoke run).
bench: setup
	HF_HUB_OFFLINE=1 $(PY) train/run.py tracking=none "stages=[data,extract]" $(ARGS)
	HF_HUB_OFFLINE=1 $(PY) train/run.py tracking=none head=medusa "stages=[data,extract]" $(ARGS)
	HF_HUB_OFFLINE=1 $(PY) scripts/bench_extract.py $(ARGS)
	HF_HUB_OFFLINE=1 $(PY) scripts/bench_train.py $(ARGS)
	HF_HUB_OFFLINE=1 $(PY) scripts/bench_decode.py $(ARGS)

clean:
	rm -rf outputs multirun .pytest_cache
