#!/usr/bin/env bash
# The device check in one lease of a lent GPU (docs/design.md §18.3). Run from the repository
# root on the GPU machine with `.gpucarry` carried (`python -m bench.gpu_carry build` writes it:
# the trimmed FlashInfer tree, the device's apache-tvm-ffi wheel and the pinned transformers).
# The image brings torch (CUDA 13), Triton, nvcc and ninja; FlashInfer JIT-builds the kernels
# the check runs, for sm90a only. Everything lands in $OUT: machine.txt, log.txt, gpu_check.md,
# gpu_check.json (the table is rewritten after each step, so a timeout keeps what ran).
# Extra arguments go to `swaserve bench gpu-check` (e.g. --only kernels graph-logits).
set -uo pipefail
OUT=${OUT:-/tmp/gpu-check-out}
SITE=/tmp/swaserve-site
mkdir -p "$OUT" "$SITE"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .gpucarry/*.whl || exit 3
tar -xJf .gpucarry/flashinfer.tar.xz -C "$SITE" || exit 3
export PYTHONPATH="$PWD:$SITE" PYTHONUNBUFFERED=1 MAX_JOBS=16 \
    FLASHINFER_WORKSPACE_BASE=/tmp/flashinfer-ws FLASHINFER_CUDA_ARCH_LIST=9.0a \
    SWASERVE_CACHE_DIR=/tmp/swaserve-cache
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    nvcc --version | tail -2
    python3 -c 'import torch, triton, transformers, flashinfer; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, "transformers", transformers.__version__, "flashinfer", flashinfer.__version__)'
} >"$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
timeout "${GPU_CHECK_SECONDS:-540}" python3 -c \
    'import sys; from bench.cli import main; sys.exit(main(["gpu-check", *sys.argv[1:]]))' \
    --out "$OUT" "$@" 2>&1 | tee "$OUT/log.txt"
