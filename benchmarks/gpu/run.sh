#!/usr/bin/env bash
# One device call for issue #32: the GPU benchmark (`measure.py`), then the CUDA tests (and with ROWS=1 the benchmark
# again on verispec's row-invariant kernels, without Hugging Face). On the GPU machine,
# from the repository root: benchmarks/gpu/run.sh "$OUT"   (about 5 minutes on an H200; results in OUT/gpu.jsonl)
set -u
out=${1:-.}
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
timeout 330 python3 benchmarks/gpu/measure.py --out "$out/gpu.jsonl" --workdir /tmp 2>&1 | grep -v "Writing\|Loading weights" | cut -c1-600
timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_cuda_graphs.py tests/test_device.py tests/test_cuda_kernels.py \
    -k "cuda or graphs or gpu" 2>&1 | tail -25
if [ "${ROWS:-0}" = 1 ]; then  # the same models on verispec's row-invariant kernels (`models/cuda_linear.py`, `cuda_attention.py`)
    VERISPEC_CUDA_KERNELS=rows timeout 330 python3 benchmarks/gpu/measure.py --out "$out/gpu-rows.jsonl" --workdir /tmp \
        --hf-methods none 2>&1 | grep -v "Writing\|Loading weights" | cut -c1-600
fi
