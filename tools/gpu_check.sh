#!/usr/bin/env bash
# GPU check of pagedlab, for a borrowed CUDA machine with no network. A loan is 15 minutes,
# start-up included, and a command at most 10, so the check comes in two prepared commands of
# under 8 minutes each on an H200 (the timeouts of a part add up to 480 s):
#
#   bash tools/gpu_check.sh            part 1: the -m gpu tests, the rest of the suite beside them
#                                      (on the CPU cores), the decode and varlen kernel tables,
#                                      the engine on SmolLM2's shape (64 requests, one repeat)
#   bash tools/gpu_check.sh --part 2   the chapters at the large preset (needs IPython and
#                                      ipywidgets, carried as wheels), the engine on Llama-3-8B's
#                                      shape (256 requests, three repeats)
#   bash tools/gpu_check.sh --dry-run  every step of both parts on a CPU, each sized to seconds
#                                      (what CI runs, so that nothing fails on the GPU for a reason
#                                      a CPU could have shown); results under a temporary $OUT
#
# Needs python3 with torch, triton, numpy, pytest, hypothesis and transformers. Writes each
# step's log and tables under $OUT (default benchmarks/results) and summary-partN.txt, with
# each step's exit status; with PACK=1, one archive of them, $OUT/gpu-check-partN.tgz. Every
# step has a timeout; the script exits non-zero if any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
part= dry=0
while [ $# -gt 0 ]; do
  case $1 in
    --part) part=$2; shift ;;
    --dry-run) dry=1 ;;
    *) echo "usage: $0 [--part 1|2] [--dry-run]" >&2; exit 2 ;;
  esac
  shift
done
case $part in 1|2|"") ;; *) echo "$0: --part must be 1 or 2, not '$part'" >&2; exit 2 ;; esac
if [ "$dry" = 1 ] && [ -z "${OUT:-}" ]; then OUT=$(mktemp -d /tmp/gpu-check-dry.XXXXXX); fi
if [ "$dry" = 1 ] && [ -z "$part" ]; then  # a dry run rehearses both parts
  export OUT
  bash "$0" --dry-run --part 1; first=$?
  bash "$0" --dry-run --part 2; exit $(( first || $? ))
fi
part=${part:-1}
OUT=${OUT:-benchmarks/results}
PY=${PYTHON:-python3}
size=large; [ "$dry" = 1 ] && size=small
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PAGEDLAB_SIZE=$size HF_HUB_OFFLINE=1
mkdir -p "$OUT"
summary="$OUT/summary-part$part.txt"
failed=0

# step NAME SECONDS CMD...: run CMD under a timeout, its output in $OUT/NAME.log; record it.
step() {
  local name=$1 seconds=$2; shift 2
  local start=$SECONDS
  timeout "$seconds" "$@" >"$OUT/$name.log" 2>&1
  local status=$?
  echo "$name: exit $status after $(( SECONDS - start )) s (limit $seconds s)" | tee -a "$summary"
  tail -n 3 "$OUT/$name.log"
  [ "$status" = 0 ] || failed=1
}
# pick GPU_ARGS -- DRY_ARGS: one argument a line, those of this run (after -- in a dry run).
pick() {
  local i
  for (( i = 1; i <= $#; i++ )); do [ "${!i}" = -- ] && break; done
  if [ "$dry" = 1 ]; then printf '%s\n' "${@:i+1}"; else printf '%s\n' "${@:1:i-1}"; fi
}

"$PY" -c "import torch, triton, transformers; print('torch', torch.__version__, '| triton',
triton.__version__, '| transformers', transformers.__version__, '|',
torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'NO CUDA')" | tee "$summary"
echo "part $part$([ "$dry" = 1 ] && echo ', dry run'), size preset $size, $(date -u +%FT%TZ)" \
  | tee -a "$summary"

if [ "$part" = 1 ]; then
  parallel=()  # pytest-xdist, where installed: 6 workers of 2 threads on 16 cores
  "$PY" -c "import xdist" 2>/dev/null && [ "$dry" = 0 ] && parallel=(-n 6)
  mapfile -t gpu_args < <(pick -m gpu tests/test_kernels_*.py tests/test_hardware.py tests/test_graphs.py -q -rs \
    -- -m gpu --collect-only -q tests/test_kernels_*.py tests/test_hardware.py tests/test_graphs.py)
  mapfile -t suite_args < <(pick tests -m "not gpu" -q -ra -p no:benchmark \
    --ignore=tests/test_book.py --ignore=tests/test_assignments.py \
    -- -q tests/test_hardware.py tests/test_device.py)
  step gpu-tests 200 "$PY" -m pytest -p no:cacheprovider "${gpu_args[@]}" &
  OMP_NUM_THREADS=2 step suite 200 "$PY" -m pytest -p no:cacheprovider "${parallel[@]}" \
    "${suite_args[@]}" &
  wait
  grep -q "exit [^0]" "$summary" && failed=1  # the two steps above ran in subshells
  mapfile -t decode_args < <(pick --budget-s 60 -- --budget-s 0)
  step bench-decode 120 "$PY" benchmarks/bench_decode.py --out "$OUT/decode-gpu.json" \
    "${decode_args[@]}"
  step bench-varlen 60 "$PY" benchmarks/bench_varlen.py --out "$OUT/varlen-gpu.json"
  mapfile -t engine_args < <(pick --models smollm2 --requests 64 --repeats 1 \
    -- --models smollm2-shape --requests 2 --scale 0.02 --repeats 1)
  step bench-engine-smollm2 100 "$PY" benchmarks/bench_engine.py --out "$OUT/smollm2" \
    "${engine_args[@]}"
else
  # Chapter 10 simulates on the CPU (CI runs it); chapter 13 serves over HTTP with FastAPI,
  # which a machine without network has only if it was carried.
  chapters=(book/ch0[1-9]_*.ipynb book/ch1[12]_*.ipynb)
  [ "$dry" = 1 ] && chapters=(book/ch01_*.ipynb)
  step chapters 300 "$PY" tools/run_chapters.py "${chapters[@]}" --jobs 3 --timeout 280
  mapfile -t engine_args < <(pick --models llama3-8b-shape --requests 256 --repeats 3 \
    -- --models smollm2-shape --requests 2 --scale 0.02 --repeats 1)
  step bench-engine-llama3 180 "$PY" benchmarks/bench_engine.py --out "$OUT/llama3" \
    "${engine_args[@]}"
fi

echo "gpu_check part $part: $([ "$failed" = 0 ] && echo passed || echo FAILED)" | tee -a "$summary"
if [ -n "${PACK:-}" ]; then  # a borrowed machine returns few files: one archive of them all
  tar czf "/tmp/gpu-check-part$part.tgz" -C "$OUT" . && rm -rf "${OUT:?}"/* &&
    mv "/tmp/gpu-check-part$part.tgz" "$OUT/"
fi
exit $failed
