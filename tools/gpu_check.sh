#!/usr/bin/env bash
# GPU check of pagedlab's kernels, for a borrowed CUDA machine with no network: the -m gpu
# kernel tests, then the decode benchmark. Needs python3 with torch, triton, numpy and pytest
# (no jupyter, no hypothesis). Writes everything under $OUT (default benchmarks/results).
# About 5 minutes: the benchmark skips its slow baselines after --budget-s seconds.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"

"$PY" -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__,
'|', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'NO CUDA')" | tee "$OUT/versions.txt"

timeout 150 "$PY" -m pytest -m gpu tests/test_kernels_*.py -q -p no:cacheprovider \
  --junitxml="$OUT/gpu-tests.xml" 2>&1 | tee "$OUT/gpu-tests.log"
tests=${PIPESTATUS[0]}

timeout 210 "$PY" benchmarks/bench_decode.py --budget-s 100 --out "$OUT/decode-gpu.json" 2>&1 \
  | tee "$OUT/bench-decode.log"
bench=${PIPESTATUS[0]}

echo "gpu_check: tests exit $tests, benchmark exit $bench (results in $OUT)"
exit $(( tests || bench ))
