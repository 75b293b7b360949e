"""The two longest parts of a first run (`benchmarks/probes/first_run.sh` times the whole), each done now against
before: compiling kquant's kernels (its source as `kernels.extension` compiles it, against `torch/extension.h` alone,
the header it no longer includes, and with OTHER=<checkout> that checkout's source), and reading the GGUF's tokenizer
folder (`gguf_tokenizer_folder`, one parse of the file, against transformers' tokenizer and config, two parses).

    .venv/bin/python benchmarks/probes/first_run_parts.py        # OTHER=/path/to/checkout adds its kquant.cpp
"""

from __future__ import annotations

import os
import subprocess
import sysconfig
import tempfile
import time
from pathlib import Path

from torch.utils.cpp_extension import include_paths

from verispec.models import kernels
from verispec.models.registry import DEFAULT_TARGET, gguf_file, gguf_tokenizer_folder
from verispec.paths import cpu_summary


def compile_seconds(source: Path) -> float:
    """Seconds to compile `source` to an object file with the extension's flags and torch's include paths."""
    flags = [*kernels.FLAGS, "-fPIC", "-std=c++20", "-DTORCH_EXTENSION_NAME=verispec_kquant", "-DTORCH_API_INCLUDE_EXTENSION_H",
             *(f"-I{path}" for path in [*include_paths(), sysconfig.get_paths()["include"]])]
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        subprocess.run(["c++", *flags, "-c", str(source), "-o", f"{out}/x.o"], check=True)
        return time.perf_counter() - start


def main() -> None:
    print(cpu_summary())
    source = Path(kernels.__file__).with_name("kquant.cpp")
    with tempfile.TemporaryDirectory() as folder:
        header = Path(folder) / "extension.cpp"
        header.write_text("#include <torch/extension.h>\n")
        print(f"compiling kquant.cpp {compile_seconds(source):.1f} s; torch/extension.h alone {compile_seconds(header):.1f} s")
    if os.environ.get("OTHER"):
        other = Path(os.environ["OTHER"]) / "src/verispec/models/kernels/kquant.cpp"
        print(f"compiling {other} {compile_seconds(other):.1f} s")
    from transformers import AutoConfig, AutoTokenizer

    gguf = gguf_file(DEFAULT_TARGET)
    with tempfile.TemporaryDirectory() as cache:
        os.environ["VERISPEC_CACHE"] = cache
        start = time.perf_counter()
        gguf_tokenizer_folder(gguf)
        now = time.perf_counter() - start
    start = time.perf_counter()
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    print(f"the GGUF's tokenizer folder {now:.1f} s; transformers' tokenizer and config {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
