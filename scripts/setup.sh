#!/usr/bin/env bash
# Set up verispec in ./.venv (created if missing) and install what it needs.
#
#   scripts/setup.sh          the package and its runtime dependencies
#   scripts/setup.sh --test   also the test dependencies (pytest, scipy, the server test clients), Ray
#                             (the `ray` extra: serve --ray, batch) and, where apt-get may run, Debian's
#                             Chromium for the playground's browser test
#
# torch: a torch already importable in the venv (or in the system site-packages it sees, e.g. a
# CUDA build) is kept. Otherwise torch==2.13.0 is installed: on the CPU machines this project runs
# on, pip finds a local CPU wheel for it, while an unpinned `torch` would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."

extras=""
[[ "${1:-}" == "--test" ]] && extras="[test,ray]"

if [[ ! -x .venv/bin/python ]]; then
    python3 -m venv --system-site-packages .venv
fi
py=.venv/bin/python
$py -m pip install --quiet --upgrade pip

if ! $py -c "import torch" 2>/dev/null; then
    echo "installing torch==2.13.0 (CPU wheel where one is available)" >&2
    $py -m pip install --quiet "torch==2.13.0"
fi
$py -m pip install --quiet -e ".${extras}"
if [[ -n "$extras" ]] && ! command -v chromium >/dev/null && command -v apt-get >/dev/null && [[ $EUID -eq 0 ]]; then
    echo "installing Debian's chromium for the playground test (skipped by that test when absent)" >&2
    (apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null) || echo "chromium not installed" >&2
fi
echo "verispec is set up in .venv ($($py -c 'import torch; print("torch", torch.__version__)'))" >&2
