#!/usr/bin/env bash
# Set up verispec in ./.venv (created if missing) and install what it needs.
#
#   scripts/setup.sh          the package and its runtime dependencies
#   scripts/setup.sh --test   also the test dependencies (pytest, scipy, the server test clients), Ray
#                             (the `ray` extra: serve --ray, batch) and, where apt-get may run, Debian's
#                             Chromium for the playground's browser test
#
# torch: a torch already importable in the venv (or in the system site-packages it sees, e.g. a
# CUDA build) is kept. Otherwise torch==2.13.0 is installed with pip: on the CPU machines this project
# runs on, pip finds a local CPU wheel for it, while an unpinned `torch` would pull a multi-GB CUDA
# build. The other dependencies install with uv (installed here by pip), which downloads in parallel
# and caches what it downloaded, so a second checkout's venv takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

extras=""
[[ "${1:-}" == "--test" ]] && extras="[test,ray]"

if [[ ! -x .venv/bin/python ]]; then
    python3 -m venv --system-site-packages .venv
fi
py=.venv/bin/python
$py -m pip install --quiet --upgrade pip uv

if ! $py -c "import torch" 2>/dev/null; then
    echo "installing torch==2.13.0 (CPU wheel where one is available)" >&2
    $py -m pip install --quiet "torch==2.13.0"
fi
# llama.cpp (llama-cpp-python, the gguf backend) compiles from source for this CPU (-march=native,
# about 8 minutes on 2 cores). A native build crashes on a CPU without the same instructions, so the
# wheel is kept under a key of this CPU's instruction-set flags: a machine of another CPU kind that
# shares the cache builds its own, and pip's own wheel cache is bypassed. Without AMX: ggml's AMX
# kernels crash at the first decode on the AMX Xeons here (ggml-org/llama.cpp#20824, machine-dependent,
# unfixed upstream); the build keeps every other instruction set of -march=native (GCC's -mno-* wins
# whatever the order; CMake takes CFLAGS and CXXFLAGS as its initial flags).
llama_version=0.3.36
no_amx=""
if [[ "$(uname -m)" == x86_64 ]]; then no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"; fi
cpu_key=$( (grep -m1 '^flags' /proc/cpuinfo 2>/dev/null; echo "$no_amx") | sha256sum | cut -c1-12)
wheels="${VERISPEC_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/verispec}/wheels/llama-cpp-$llama_version-$cpu_key"
marker=.venv/llama-cpp-cpu-key
if [[ "$(cat "$marker" 2>/dev/null)" != "$cpu_key" ]] || ! $py -c "import llama_cpp" 2>/dev/null; then
    if ! ls "$wheels"/llama_cpp_python-*.whl >/dev/null 2>&1; then
        echo "building llama.cpp for this CPU (once per CPU kind; about 8 minutes on 2 cores)" >&2
        mkdir -p "$wheels"
        CMAKE_ARGS="-DGGML_NATIVE=ON" CFLAGS="$no_amx" CXXFLAGS="$no_amx" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
            $py -m pip wheel --no-deps --no-cache-dir --verbose -w "$wheels" "llama-cpp-python==$llama_version" 2>&1 \
            | grep --line-buffered -oE '^ *\[[0-9]+/[0-9]+\]' | while read -r step; do printf '\r  compiling %s' "$step" >&2; done || true
        echo >&2
        ls "$wheels"/llama_cpp_python-*.whl >/dev/null 2>&1 || { echo "llama-cpp-python failed to build" >&2; exit 1; }
    fi
    $py -m pip install --quiet --force-reinstall --no-deps "$wheels"/llama_cpp_python-*.whl
    $py -m pip install --quiet "diskcache>=5.6.1" "jinja2>=2.11.3" "typing-extensions>=4.5.0"
    echo "$cpu_key" > "$marker"
fi
# uv does not see a torch in the system site-packages, so torch (importable by now) is excluded from
# its resolution; pip is the fallback.
if ! $py -m uv pip install --quiet --python "$py" --excludes <(echo torch) -e ".${extras}"; then
    echo "uv could not install the dependencies; trying pip" >&2
    $py -m pip install --quiet -e ".${extras}"
fi
if [[ -n "$extras" ]] && ! command -v chromium >/dev/null && command -v apt-get >/dev/null && [[ $EUID -eq 0 ]]; then
    echo "installing Debian's chromium for the playground test (skipped by that test when absent)" >&2
    (apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null) || echo "chromium not installed" >&2
fi
echo "verispec is set up in .venv ($($py -c 'import torch; print("torch", torch.__version__)'))" >&2
