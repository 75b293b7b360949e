#!/usr/bin/env bash
# The Ray numbers of BENCHMARKS.md ("Ray", issue #7): serving with 1 vs 2 replicas through Serve's
# proxy (and plain `verispec serve` for reference), then batch generation in one process vs on Ray.
# Needs the `ray` extra (scripts/setup.sh --test installs it) and port 8731 free. About 25 minutes on
# the 2-core machine of BENCHMARKS.md. Writes its inputs and outputs under ${OUT:-bench-ray/}.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
out=${OUT:-bench-ray}
mkdir -p "$out"
model=(--target smollm2-135m-instruct --draft ngram)
log() { echo "== $(date +%T) load average $(cut -d' ' -f1-3 /proc/loadavg) :: $*"; }

# the 17 prompts of the `own` set, twice: 34 records; the serving prompt is one of them
$py -c "import json; from verispec.tools.bench.prompts import PROMPTS; print('\n'.join(json.dumps({'id': f'{p.name}-{k}', 'prompt': p.text}) for k in range(2) for p in PROMPTS))" > "$out/own34.jsonl"
prompt="$($py -c 'from verispec.tools.bench.prompts import PROMPTS; print(next(p.text for p in PROMPTS if p.name == "sum-lighthouse"))')"

serve_levels() {  # label, then extra `verispec serve` options
    local label=$1; shift
    log "serve $label: $*"
    $py -m verispec.cli serve --port 8731 "${model[@]}" --max-batch 8 "$@" > "$out/serve-$label.log" 2>&1 &
    local pid=$!
    for _ in $(seq 300); do $py -c "import httpx; httpx.get('http://127.0.0.1:8731/health').raise_for_status()" 2>/dev/null && break; sleep 1; done
    $py -m verispec.tools.bench.loadtest --url http://127.0.0.1:8731 --clients 1,4,16 --requests 16 --max-tokens 64 --chat --prompt "$prompt"
    kill -TERM $pid && wait $pid || true
}
serve_levels plain
serve_levels ray-1x2cpu --ray --replicas 1 --replica-cpus 2
serve_levels ray-2x1cpu --ray --replicas 2 --replica-cpus 1

batch() {  # label, then extra `verispec batch` options
    local label=$1; shift
    rm -rf "$out/batch-$label"
    log "batch $label: $*"
    $py -m verispec.cli batch --input "$out/own34.jsonl" --output "$out/batch-$label" "${model[@]}" --max-new-tokens 64 "$@" 2> "$out/batch-$label.err"
}
batch local-seq --local --batch-size 1 --actor-cpus 2
batch local-b8 --local --batch-size 8 --actor-cpus 2
batch ray-1x2cpu --actors 1 --actor-cpus 2 --batch-size 8
batch ray-2x1cpu --actors 2 --actor-cpus 1 --batch-size 8
log done
