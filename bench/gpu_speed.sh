#!/usr/bin/env bash
# Issues 35 and 47's speed tables on a CUDA machine without internet (docs/results.md, "Speed where people
# train"): installs MLX's CUDA build from carried wheels, then runs bench/throughput.py's tables,
# most important first, each appended to OUT/throughput-gpu.txt as it finishes.
#
#   bench/gpu_speed.sh WHEELS OUT
#
# WHEELS: mlx==0.32.4, mlx-cuda-13==0.32.4, mlx-lm, zeroconf, ifaddr for Python 3.12 (pip download
# --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_35_x86_64 ...);
# mlx-cuda-13's wheel may come in two parts, cuda.part.aa (in ~ from an earlier call) and
# cuda.part.ab (in WHEELS). The "before" rows need the package of the commit before issue 35 in
# .base/ (git worktree add /tmp/base 78320fe && cp -r /tmp/base/mlx_diloco /tmp/base/models .base/).
# SMALL=1 runs the same tables on tiny models (a check of this script on a CPU).
set -uo pipefail
cd "$(dirname "$0")/.."
wheels=$1 out=$2
site=/tmp/mlx-site
mkdir -p "$out"
log=$out/throughput-gpu.txt

if [ -f ~/cuda.part.aa ] && [ -f "$wheels/cuda.part.ab" ]; then
  mkdir -p /tmp/wheels
  cat ~/cuda.part.aa "$wheels/cuda.part.ab" > /tmp/wheels/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl
  cp "$wheels"/*.whl /tmp/wheels/ && wheels=/tmp/wheels
fi
if ls "$wheels"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$wheels"/*.whl \
    || { echo "installing the wheels failed" | tee -a "$log"; exit 1; }
  # libmlx's rpath looks for the CUDA libraries beside it, in nvidia/: PyTorch's
  torch_site=$(python3 -c 'import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))')
  [ -d "$torch_site/nvidia" ] && ln -sfn "$torch_site/nvidia" "$site/nvidia"
  export PYTHONPATH=$site
fi
export MLX_DILOCO_NO_BLAS_FIX=1 PYTHONUNBUFFERED=1
python3 -c 'import mlx.core as mx; print("MLX", mx.__version__, mx.default_device(), mx.device_info())' 2>&1 | tee -a "$log"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | tee -a "$log"

t0=$(date +%s)
run() {  # bench/throughput.py with these arguments, its output appended to the log
  echo "== $(( $(date +%s) - t0 )) s: python bench/throughput.py $*" | tee -a "$log"
  timeout 300 python3 bench/throughput.py "$@" 2>&1 | grep -v "^warning: MLX matmul" | tee -a "$log"
}
kernels() {  # bench/step_kernels.py: the kernels one step launches, one worker and vmapped
  echo "== $(( $(date +%s) - t0 )) s: python bench/step_kernels.py $*" | tee -a "$log"
  timeout 300 python3 bench/step_kernels.py "$@" 2>&1 | grep -v "^warning: MLX matmul" | tee -a "$log"
}
# Issue 47's order: the LoRA table (never measured on a GPU), the bf16 and vmapped rows (the step
# tables), then the vmapped step's profile (the parts table: forward and backward against the
# update; the kernel counts of bench/step_kernels.py), then the causes and the rest.
if [ -n "${SMALL:-}" ]; then
  run --lora-model llama-tiny --batch-size 4 --seq-len 32 --precisions bf16 --tables lora --steps 3
  run --model tiny --batch-size 8 --seq-len 32 --precisions bf16 fp32 --tables step --steps 3
  run --model tiny --batch-size 8 --seq-len 32 --precisions bf16 --tables parts --steps 3
  kernels --model tiny --precisions bf16 --batch-size 8 --seq-len 32
  run --model tiny --batch-size 8 --seq-len 32 --precisions bf16 --tables causes --steps 3
  run --model llama-tiny --batch-size 8 --seq-len 32 --precisions fp32 --tables step --steps 3
else
  run --lora-model llama-1b --batch-size 4 --seq-len 512 --precisions bf16 --tables lora
  run --model gpt2-124m --batch-size 8 --seq-len 1024 --precisions bf16 --tables step
  run --model gpt-10m --batch-size 32 --seq-len 256 --precisions bf16 fp32 --tables step
  run --model gpt2-124m --batch-size 8 --seq-len 1024 --precisions bf16 --tables parts --steps 6
  kernels --model gpt2-124m --precisions bf16
  run --model gpt2-124m --batch-size 8 --seq-len 1024 --precisions bf16 --tables causes --steps 6
  run --model llama-150m --batch-size 8 --seq-len 1024 --precisions bf16 fp32 --tables step
  run --lora-model llama-1b --batch-size 4 --seq-len 512 --precisions fp32 --tables lora
fi
echo "== done in $(( $(date +%s) - t0 )) s" | tee -a "$log"
