# The two commands of the quick start. Both create .venv on a fresh machine.
# torch is pinned in the set-up path so a CPU machine takes the local CPU build
# instead of pulling a multi-GB CUDA wheel; pyproject.toml only asks for torch>=2.11.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_PIN ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: setup train test bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_PIN)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

train: $(STAMP)
	$(BIN)/shardline train $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# CPU benchmarks; on a GPU machine also run `benchmarks/gpu_train.py` (see benchmarks/README.md).
bench: $(STAMP)
	$(BIN)/python benchmarks/step_overhead.py
	$(BIN)/python benchmarks/parallel_overhead.py
	$(BIN)/python benchmarks/gpu_train.py --tiny

clean:
	rm -rf $(VENV) runs .pytest_cache
