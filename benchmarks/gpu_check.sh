#!/usr/bin/env bash
# The GPU check in one command, for a lent GPU machine that has its own torch and no package
# index: runner's other dependencies from .whl/ (built beforehand on a machine with the
# index: ../shared/gpu-host/wheels.sh, then named in the run's carry), the CUDA suite
# (tests/gpu/suite.py), the gpu_plan bench (parallelism=auto's plan against measured runs),
# then the gpu_speed bench, each within a budget, so that the whole fits in about 8 minutes.
# What they wrote is copied to $OUT (default ./gpu-check): tests.txt (the GPU's name, the
# suite's output and summary), plan_peaks.jsonl (each layout's predicted and measured peak),
# plan_bench.txt and bench.txt (the benches' progress), gpu_plan.md, gpu_plan_runs.json,
# gpu_speed.md.
#
#   bash benchmarks/gpu_check.sh [TESTS_S] [PLAN_S] [BENCH_S]   # default 230, 100, 100 s
#
# The bench starts no measurement after its budget; its table holds the rows measured by
# then and names the others. Exit status: the suite's.
set -uo pipefail
cd "$(dirname "$0")/.."
tests_s=${1:-230}
plan_s=${2:-100}
bench_s=${3:-100}
out=${OUT:-gpu-check}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps .whl/*.whl 2>&1 | tail -3
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1 | tail -3
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>&1 | tee "$out/tests.txt"

started=$(date +%s)
RUNNER_GPU_REPORT=$(realpath "$out") timeout -k 10 "$tests_s" python3 tests/gpu/suite.py \
  >>"$out/tests.txt" 2>&1
tests_rc=$?
echo "tests/gpu: exit $tests_rc after $(( $(date +%s) - started )) s" | tee -a "$out/tests.txt"
tail -40 "$out/tests.txt"

started=$(date +%s)
timeout -k 10 $(( plan_s + 60 )) python3 benchmarks/bench.py --suite gpu_plan --reps 1 \
  --budget "$plan_s" >"$out/plan_bench.txt" 2>&1
echo "gpu_plan: exit $? after $(( $(date +%s) - started )) s" | tee -a "$out/plan_bench.txt"
cp benchmarks/results/gpu_plan.md benchmarks/results/gpu_plan_runs.json "$out/" 2>/dev/null
cat "$out/gpu_plan.md" 2>/dev/null | head -30

started=$(date +%s)
# one measurement may run past the budget: the limit here leaves it 90 s to finish
timeout -k 10 $(( bench_s + 90 )) python3 benchmarks/bench.py --suite gpu_speed --reps 3 \
  --budget "$bench_s" >"$out/bench.txt" 2>&1
echo "gpu_speed: exit $? after $(( $(date +%s) - started )) s" | tee -a "$out/bench.txt"
cp benchmarks/results/gpu_speed.md "$out/" 2>/dev/null && cat "$out/gpu_speed.md"
exit "$tests_rc"
