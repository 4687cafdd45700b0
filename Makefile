# `make run` and `make test` set everything up by themselves (see README.md; the docs: make docs).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install run test test-report test-fast test-floor test-gpu test-matrix test-ray test-sweeps test-slurm lint bench profile clean-runs docs docs-serve

install: $(STAMP)

# Reinstall when the dependency pins change. The stack is installed with uv (pinned in
# constraints.txt): 42 s here where pip took about 2 minutes. uv reads no pip settings, so
# a local CPU-only torch wheel (PIP_FIND_LINKS) never shadows the pinned build from the
# index. Every module is compiled up front (--compile-bytecode): with
# PYTHONDONTWRITEBYTECODE set, as on this machine, a venv without .pyc files recompiles
# torch on every import (9-14 s instead of 4 s per process; make test 2.3x slower).
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	PIP_FIND_LINKS= $(BIN)/python -m pip install --quiet -c constraints.txt uv
	$(BIN)/uv pip install --python $(BIN)/python --quiet --compile-bytecode \
		-c constraints.txt -e '.[dev]'
	$(BIN)/python -m runner.engines.deepspeed_ops
	touch $(STAMP)

run: install
	$(BIN)/runner $(ARGS)

# pytest rewrites a test module's asserts as it imports it and keeps the result beside its
# bytecode, unless told to write none (PYTHONDONTWRITEBYTECODE, set on this machine): then each
# worker of every test run rewrote every module again. The test targets write bytecode (the
# checkout's __pycache__ folders, which git ignores): collecting the suite, 13 -> 11 s of CPU
# per worker here once the folders exist.
test test-fast test-matrix test-sweeps test-ray test-slurm test-floor: export PYTHONDONTWRITEBYTECODE :=

# Side by side: TEST_WORKERS pytest-xdist workers, a test module to each (its module-scoped
# runs are made once), in the order tests/conftest.py gives them (the longest modules first;
# xdist would otherwise start the modules with the most tests first, and end on Ray's). A
# test's time is mostly processes starting and waiting, so on this 2-core machine 3 workers
# keep both cores busy (make test: 23 min one at a time; 4 workers: slower than 3).
TEST_WORKERS ?= 3
test: install
	RUNNER_TEST_TARGET=test $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder \
		-m "not ray and not matrix and not sweeps" $(PYTEST_ARGS)

# What each test module cost in the last run of each target (wall and CPU seconds, the ranks'
# included, tests, runs launched), most expensive first: tests/helpers/cost.py records it
# into .test-cost/ on every run. REPORT_ARGS: targets, --top N, --scopes, --runs MODULE,
# --tests MODULE (its tests by CPU seconds); --schedule
# rewrites tests/durations.json, the order make test starts its modules in.
test-report:
	@$(BIN)/python -m tests.helpers.cost_report $(REPORT_ARGS)

# The tests that run sweeps (runner -m: every launcher and sweeper, resumed and stopped
# sweeps, a sweep's directory), side by side as make test runs; Ray's are make test-ray's.
test-sweeps: install
	RUNNER_TEST_TARGET=test-sweeps $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder \
		-m "sweeps and not ray" $(PYTEST_ARGS)

# The rest of the equivalence and parallelism matrices (marked `matrix`): further splits,
# engines and meshes of claims `make test` proves once each, side by side as make test runs.
# CI runs it after make test; together they are every case.
test-matrix: install
	RUNNER_TEST_TARGET=test-matrix $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder \
		-m "matrix and not ray" $(PYTEST_ARGS)

# The tests that start a local Ray cluster (launcher=ray, hydra/launcher=tune), one at a
# time: a run on Ray costs about 37 CPU-seconds, most of them in Ray's own processes, and
# each test checks that the host's Ray processes are gone after it.
test-ray: install
	RUNNER_TEST_TARGET=test-ray $(BIN)/python -m pytest -m ray $(PYTEST_ARGS)

# The fast tier: every test that starts no process (a run, a rank, a worker), on two workers
# (imports and composition keep one core busy each: 53 s here where one worker took 103 s).
# tests/conftest.py fails a test outside `slow` that starts one.
test-fast: install
	RUNNER_TEST_TARGET=test-fast $(BIN)/python -m pytest -n 2 -m "not slow" $(PYTEST_ARGS)

# The oldest torch runner supports (runner/cli/torch_release.py; pyproject.toml declares
# it), in an environment of its own, set up as a GPU image has it: torch and torchvision
# first, then runner installed beside them, which must leave them as they are (checked).
# The fast tier and the real runs marked `floor` (ddp, fsdp with an async checkpoint, zero2,
# compile, restarts, a restart said on the terminal and early stopping through it) run
# against it. Its own torch_extensions: DeepSpeed's op is built
# for each torch.
FLOOR_TORCH  := 2.11.0
FLOOR_VISION := 0.26.0
FLOOR_VENV   := .venv-floor
FLOOR_STAMP  := $(FLOOR_VENV)/.installed

$(FLOOR_STAMP): pyproject.toml constraints.txt $(STAMP)
	rm -rf $(FLOOR_VENV)
	$(BIN)/uv venv --quiet --python $(PYTHON) $(FLOOR_VENV)
	$(BIN)/uv pip install --python $(FLOOR_VENV)/bin/python --quiet --compile-bytecode \
		torch==$(FLOOR_TORCH) torchvision==$(FLOOR_VISION)
	grep -vE '^(torch|torchvision|triton|nvidia-|cuda-)' constraints.txt > $(FLOOR_VENV)/constraints.txt
	$(BIN)/uv pip install --python $(FLOOR_VENV)/bin/python --quiet --compile-bytecode \
		-c $(FLOOR_VENV)/constraints.txt -e '.[dev]'
	$(FLOOR_VENV)/bin/python -c "import torch, sys; v = torch.__version__; \
		sys.exit(0 if v.startswith('$(FLOOR_TORCH)') else f'installing runner replaced torch $(FLOOR_TORCH) with {v}')"
	$(FLOOR_VENV)/bin/python -m runner.engines.deepspeed_ops
	touch $(FLOOR_STAMP)

test-floor: $(FLOOR_STAMP)
	RUNNER_TEST_TARGET=test-floor $(FLOOR_VENV)/bin/python -m pytest -m "not slow or floor" $(PYTEST_ARGS)

# The CUDA-only suite (tests/gpu: every parallelism in fp32, bf16 and fp16 over NCCL, meta
# init, async checkpoints and a restart, export and eval, the guards, compile, no host sync
# on quiet steps, a real out-of-memory error), side by side where pytest-xdist is installed,
# then a one-screen summary; every test is skipped on a machine without a GPU.
test-gpu: install
	$(BIN)/python tests/gpu/suite.py $(PYTEST_ARGS)

# A real two-node SLURM cluster on this machine (root: network namespaces), the SLURM
# packages installed when missing; tests/slurm/cluster.sh brings it up and down.
# Installs Debian's slurm-wlm and munge when missing (root only); where the cluster cannot
# run (no root, no network namespaces, no packages) the tests are skipped and -rs prints why.
test-slurm: install
	@if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then \
		if [ "$$(id -u)" = 0 ]; then \
			DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge || \
				echo "test-slurm: could not install slurm-wlm and munge"; \
		else echo "test-slurm: slurm-wlm and munge are missing; installing them needs root"; fi; \
	fi
	RUNNER_SLURM_TESTS=1 RUNNER_TEST_TARGET=test-slurm $(BIN)/python -m pytest tests/slurm -m slurm -rs $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check runner hydra_plugins tests benchmarks examples docs
	$(BIN)/ruff format --check runner hydra_plugins tests benchmarks examples docs

clean-runs:
	rm -rf runs

# Benchmarks (minutes, not part of `make test`): interleaved runs, medians, ratios
# against a hand-written PyTorch script. Results land in benchmarks/results/.
bench: install
	$(BIN)/python benchmarks/bench.py $(BENCH_ARGS)

# Where the CPU time of one run goes (py-spy over every process), runner against
# the plain script: `make profile PROFILE_ARGS=--model=resnet18`.
profile: install
	$(BIN)/python benchmarks/cpu_profile.py $(PROFILE_ARGS)

# The documentation site (mkdocs-material; docs/, mkdocs.yml), warnings as errors: the
# config reference and the benchmark pages are generated from conf/, the schema and
# benchmarks/results/ while it builds. `make docs-serve` previews it.
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

docs-serve: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve
