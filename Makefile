# `make run` and `make test` set everything up by themselves (see README.md; the docs: make docs).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install run test test-fast test-gpu test-slurm lint bench profile clean-runs docs docs-serve

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

test: install
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The fast tier: every test that starts no process (a run, a rank, a worker), about half a
# minute. tests/conftest.py fails a test outside `slow` that starts one.
test-fast: install
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

# The CUDA-only suite (tests/gpu: NCCL, bf16/fp16, channels_last, compile, a real
# out-of-memory error); every test is skipped on a machine without a GPU.
test-gpu: install
	$(BIN)/python -m pytest tests/gpu -m gpu $(PYTEST_ARGS)

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
	RUNNER_SLURM_TESTS=1 $(BIN)/python -m pytest tests/slurm -m slurm -rs $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check runner tests benchmarks examples docs
	$(BIN)/ruff format --check runner tests benchmarks examples docs

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
