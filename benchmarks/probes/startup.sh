#!/usr/bin/env bash
# Time to the first token from a cold process on warm caches: `verispec generate` (the default plan) against
# llama-cpp-python loading the same GGUF and answering the same chat with one token, interleaved, ROUNDS rounds.
# OTHER=/path/to/another/checkout/src adds that code as a third arm (e.g. a worktree of an older commit).
#   bash benchmarks/probes/startup.sh            # from the repository root, with .venv set up
set -euo pipefail
cd "$(dirname "$0")/../.."
source .venv/bin/activate
unset PYTHONDONTWRITEBYTECODE  # a user's Python writes bytecode: time what they get
gguf=$(python -c "from verispec.models.registry import gguf_file; print(gguf_file('qwen2.5-coder-1.5b-instruct'))")
python -c "from verispec.paths import cpu_summary; print(cpu_summary())"
for round in $(seq "${ROUNDS:-5}"); do
  arms=("verispec:$PWD/src"); [[ -n "${OTHER:-}" ]] && arms+=("other:$OTHER")
  for arm in "${arms[@]}"; do
    PYTHONPATH=${arm#*:} /usr/bin/time -f "${arm%%:*} %e s wall, %M KB peak RSS" \
      python -m verispec.cli generate "Hi" --max-new-tokens 1 2>&1 | grep 'wall'
  done
  /usr/bin/time -f "llama-cpp-python %e s wall, %M KB peak RSS" python -c "
from llama_cpp import Llama
model = Llama('$gguf', n_threads=2, verbose=False)
model.create_chat_completion([{'role': 'user', 'content': 'Hi'}], max_tokens=1)" 2>&1 | tail -1
done
