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

# Two phases. First the tests on TEST_WORKERS pytest-xdist workers, a file to a worker at a
# time (its module fixtures are built once), the longest files first (tests/conftest.py
# HEAVY_FIRST; --no-loadscope-reorder keeps that order); then the tests marked `alone`, whose
# assertions compare timings, with nothing beside them. One torch thread per process
# (TEST_THREADS): the tiny models gain nothing from a second, and two workers' thread pools
# spinning on 2 cores cost a third more CPU time. Exit status 5 (no test selected) counts as a
# pass in a phase unless both select nothing, so `make test
# PYTEST_ARGS=tests/unit/test_config.py` works; -m and -k in PYTEST_ARGS apply to both phases.
# TEST_WORKERS=0 runs the first phase in one process. Inductor compiles in the test's own
# process (TORCHINDUCTOR_COMPILE_THREADS=1) instead of starting a pool of compile workers per
# compiling process: the compile tests from an empty cache took 209 s that way against 227 s
# with the default pool (one run each, 2 workers).
TEST_WORKERS ?= 2
TEST_THREADS ?= 1
PYTEST := OMP_NUM_THREADS=$(TEST_THREADS) TORCHINDUCTOR_COMPILE_THREADS=1 $(BIN)/python -m pytest -q

test: $(STAMP)
	@status=0; \
	echo "make test, phase 1 of 2: $(TEST_WORKERS) workers"; \
	$(PYTEST) -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --phase=shared $(PYTEST_ARGS); first=$$?; \
	echo "make test, phase 2 of 2: the tests marked alone"; \
	$(PYTEST) --phase=alone $(PYTEST_ARGS); second=$$?; \
	for r in $$first $$second; do [ $$r = 0 ] || [ $$r = 5 ] || status=$$r; done; \
	[ $$first$$second != 55 ] || status=5; \
	exit $$status

# CPU benchmarks; on a GPU machine also run `benchmarks/gpu_train.py` (see benchmarks/README.md).
bench: $(STAMP)
	$(BIN)/python benchmarks/step_overhead.py
	$(BIN)/python benchmarks/parallel_overhead.py
	$(BIN)/python benchmarks/gpu_train.py --tiny

clean:
	rm -rf $(VENV) runs .pytest_cache
