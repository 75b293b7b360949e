#!/usr/bin/env bash
# One device call for issue #32's open question: do verispec's row-invariant kernels (VERISPEC_CUDA_KERNELS=rows:
# `models/cuda_linear.py`, `models/cuda_attention.py`) make greedy speculation identical to plain decoding on a GPU, and
# what do they cost against cuBLAS (torch)? Their GPU tests first, then `measure.py` on random-weight models of the
# shipped shapes with each kernel choice (SmolLM2-135M, whose real τ BENCHMARKS has, then the 1.5B target with the
# 0.5B draft: `model` verifies 5 positions every step, so its agreement with plain is the batch-invariance check),
# then `linear_widths.py` (each layer at 1 … 16 rows, both shapes) and `step_kernels.py` (SmolLM2's step at 1 … 16
# positions, kernel by kernel, with each kernel choice and attention backend). At most 590 s: each step has its own limit, and
# one that runs over loses only its own records (the first call of 2026-11-27 lost the 1.5B's: see BENCHMARKS "GPU").
# On the GPU machine, from the repository root: benchmarks/gpu/kernels.sh "$OUT"
set -u
out=${1:-.}
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
quiet() { grep -v "Writing\|Loading weights\|^{" | cut -c1-300; }
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_kernels.py -k gpu 2>&1 | tail -6
for kernels in torch rows; do
    VERISPEC_CUDA_KERNELS=$kernels timeout 60 python3 benchmarks/gpu/measure.py --target smollm2-135m-instruct \
        --draft smollm2-135m-instruct --max-n 16 --eager-widths 1 --methods none,ngram@12 --hf-methods none \
        --no-launched --workdir /tmp --out "$out/small-$kernels.jsonl" 2>&1 | quiet
    VERISPEC_CUDA_KERNELS=$kernels timeout 130 python3 benchmarks/gpu/measure.py --max-n 16 --eager-widths 1 \
        --methods none,model,ngram --hf-methods none --no-launched --workdir /tmp --out "$out/big-$kernels.jsonl" 2>&1 | quiet
done
for model in qwen2.5-coder-1.5b-instruct smollm2-135m-instruct; do
    timeout 30 python3 benchmarks/gpu/linear_widths.py --model $model --calls 20 --repeats 10 \
        --out "$out/widths-$model.jsonl" 2>&1 | quiet
done
for kernels in torch rows; do  # torch's attention held to each backend in turn; rows has its own
    sdpa=$([ $kernels = torch ] && echo default,efficient,cudnn,math || echo default)
    VERISPEC_CUDA_KERNELS=$kernels timeout 90 python3 benchmarks/gpu/step_kernels.py --model smollm2-135m-instruct \
        --sdpa $sdpa --workdir /tmp --out "$out/steps-$kernels.jsonl" 2>&1 | grep -v USDT | quiet
done
python3 benchmarks/gpu/summary.py "$out"/small-*.jsonl "$out"/big-*.jsonl "$out"/widths-*.jsonl "$out"/steps-*.jsonl
