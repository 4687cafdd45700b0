#!/usr/bin/env bash
# The GPU check in one command, for a lent GPU machine that has its own torch and no package
# index: runner's other dependencies from .whl/ (built beforehand on a machine with the
# index: ../shared/gpu-host/wheels.sh, then named in the run's carry), the CUDA suite
# (tests/gpu/suite.py), then the gpu_speed bench, each within a budget, so that the whole
# fits in about 9 minutes. What they wrote is copied to $OUT (default ./gpu-check):
#   tests.txt (the suite's output and summary), bench.txt (its progress), gpu_speed.md.
#
#   bash benchmarks/gpu_check.sh [TESTS_S] [BENCH_S]    # default 270 and 210 seconds
#
# The bench starts no measurement after its budget; its table holds the rows measured by
# then and names the others. Exit status: the suite's.
set -uo pipefail
cd "$(dirname "$0")/.."
tests_s=${1:-270}
bench_s=${2:-210}
out=${OUT:-gpu-check}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps .whl/*.whl 2>&1 | tail -3
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1 | tail -3
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>&1 | tee "$out/gpu.txt"

started=$(date +%s)
timeout -k 10 "$tests_s" python3 tests/gpu/suite.py >"$out/tests.txt" 2>&1
tests_rc=$?
echo "tests/gpu: exit $tests_rc after $(( $(date +%s) - started )) s" | tee -a "$out/tests.txt"
tail -40 "$out/tests.txt"

started=$(date +%s)
# one measurement may run past the budget: the limit here leaves it two minutes to finish
timeout -k 10 $(( bench_s + 120 )) python3 benchmarks/bench.py --suite gpu_speed --reps 3 \
  --budget "$bench_s" >"$out/bench.txt" 2>&1
echo "gpu_speed: exit $? after $(( $(date +%s) - started )) s" | tee -a "$out/bench.txt"
cp benchmarks/results/gpu_speed.md "$out/" 2>/dev/null && cat "$out/gpu_speed.md"
exit "$tests_rc"
