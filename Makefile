# Two commands a newcomer needs: `make demo` and `make test`. Both create .venv on first use.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The venv's ninja first: DeepSpeed's JIT builds made by two ninja versions see each other as stale.
export PATH := $(abspath $(VENV))/bin:$(PATH)
export OMP_NUM_THREADS ?= 1
export TOKENIZERS_PARALLELISM ?= false
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1

.PHONY: install ops demo test test-fast configs lint clean

# The extras the tests import: lowbit (torchao: int8 states, optimizer.stochastic_rounding) and bench (trl: TRL's
# GRPOConfig defaults and VLLMClient in tests/test_rl_vllm_server.py). Ray (80 MB) only in CI (.ci/run).
$(STAMP): setup.cfg pyproject.toml constraints.txt Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[test,trackers,video,lowbit,bench]'
	touch $(STAMP)

install: $(STAMP)

# Compile DeepSpeed's JIT ops once (shm comm, cpu_adam, async_io); later runs reuse the cache.
ops: install
	$(PY) -m harness.ops

demo: ops
	$(VENV)/bin/harness launch --num_gpus 2 harness/run.py --recipe zero2_offload \
		--set train.steps=40 --set train.eval_every=20 --set optimizer.lr=0.003

test: ops
	$(PY) -m pytest -q --durations=40

test-fast: install
	$(PY) -m pytest -q -m "not multirank"

configs: install
	$(VENV)/bin/harness build

clean:
	rm -rf $(VENV) runs .pytest_cache
