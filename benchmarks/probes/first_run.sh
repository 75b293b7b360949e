#!/usr/bin/env bash
# A first run: `verispec generate` with the default plan on an empty VERISPEC_CACHE (the weight packages installed),
# so it compiles the kernels, reads the GGUF's tokenizer, measures both backends and plans. Prints each step's
# completion time, the plan, the wall time and the peak RSS. OTHER=/path/to/another/checkout/src runs that code
# first, on its own empty cache (e.g. a worktree of an older commit); each run takes minutes.
#   bash benchmarks/probes/first_run.sh          # from the repository root, with .venv set up
set -euo pipefail
cd "$(dirname "$0")/../.."
source .venv/bin/activate
python -c "from verispec.paths import cpu_summary; print(cpu_summary())"
arms=(); [[ -n "${OTHER:-}" ]] && arms+=("other:$OTHER"); arms+=("verispec:$PWD/src")
for arm in "${arms[@]}"; do
  cache=$(mktemp -d)
  echo "== ${arm%%:*} $(date +%T)"
  COLUMNS=200 PYTHONPATH=${arm#*:} VERISPEC_CACHE=$cache /usr/bin/time -f "wall %e s, peak RSS %M KB" \
    python -m verispec.cli generate "Write a haiku about rain." --max-new-tokens 32 2>&1 \
    | grep -E 'done|plan:|wall' | sed 's/ *progress.py:[0-9]*//'
  rm -rf "$cache"
done
