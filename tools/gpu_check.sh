#!/usr/bin/env bash
# GPU check of pagedlab, for a borrowed CUDA machine with no network and no Jupyter stack.
# First, at once: the -m gpu kernel tests; the rest of the test suite, which must pass with a
# GPU present too; the chapters at the large size preset through tools/run_chapters.py (needs
# IPython and ipywidgets). Chapter 10 is left out: it simulates on the CPU and runs in CI.
# Then, alone on the GPU, the decode and mixed-batch (varlen) benchmarks. Needs python3 with
# torch, triton, numpy, pytest, hypothesis and transformers. Writes 10 files under $OUT
# (default benchmarks/results), or one archive of them, $OUT/gpu-check.tgz, with PACK=1. About 9 minutes: each part has a timeout, the decode benchmark
# skips its slow baselines after --budget-s seconds.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PAGEDLAB_SIZE=large HF_HUB_OFFLINE=1
mkdir -p "$OUT"

"$PY" -c "import torch, triton, transformers; print('torch', torch.__version__, '| triton',
triton.__version__, '| transformers', transformers.__version__, '|',
torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'NO CUDA')" | tee "$OUT/summary.txt"

parallel=()  # pytest-xdist, where installed
"$PY" -c "import xdist" 2>/dev/null && parallel=(-n 6)  # 2 threads each: 16 cores, no contention

timeout 240 "$PY" -m pytest -m gpu tests/test_kernels_*.py tests/test_hardware.py -q -rs \
  -p no:cacheprovider >"$OUT/gpu-tests.log" 2>&1 &
gpu_tests=$!
OMP_NUM_THREADS=2 timeout 240 "$PY" -m pytest tests -m "not gpu" -q -ra -p no:cacheprovider \
  -p no:benchmark "${parallel[@]}" \
  --ignore=tests/test_book.py --ignore=tests/test_assignments.py >"$OUT/suite.log" 2>&1 &
suite=$!
chapters=(book/ch0[1-9]_*.ipynb book/ch11_*.ipynb)
timeout 250 "$PY" tools/run_chapters.py "${chapters[@]}" --jobs 3 --timeout 240 \
  >"$OUT/chapters.log" 2>&1 &
book=$!
wait $gpu_tests; gpu_tests=$?
wait $suite; suite=$?
wait $book; book=$?
tail -n 3 "$OUT/gpu-tests.log" "$OUT/suite.log"; tail -n 10 "$OUT/chapters.log"

timeout 200 "$PY" benchmarks/bench_decode.py --budget-s 80 --out "$OUT/decode-gpu.json" \
  >"$OUT/bench-decode.log" 2>&1
bench=$?
cat "$OUT/decode-gpu.md" 2>/dev/null
timeout 100 "$PY" benchmarks/bench_varlen.py --out "$OUT/varlen-gpu.json" \
  >"$OUT/bench-varlen.log" 2>&1
bench=$(( bench || $? ))
cat "$OUT/varlen-gpu.md" 2>/dev/null

echo "gpu_check exits: gpu tests $gpu_tests, suite $suite, chapters $book, benchmark $bench" \
  | tee -a "$OUT/summary.txt"
if [ -n "${PACK:-}" ]; then  # a borrowed machine returns few files: one archive of them all
  tar czf /tmp/gpu-check.tgz -C "$OUT" . && rm -f "$OUT"/* && mv /tmp/gpu-check.tgz "$OUT/"
fi
exit $(( gpu_tests || suite || book || bench ))
