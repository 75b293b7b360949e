"""How many vector values the kquant tile kernels keep on the stack, per instruction set.

An AVX2-only CPU has 16 vector registers, an AVX-512 one 32: code that fits the second can spill on the
first. The probe compiles `models/kernels/kquant.cpp` to assembly with the library's flags and each
`-march` given (nothing is run), then counts, per tile-kernel function, its instructions and those that
move a vector register to or from the stack. Static counts: a spill outside the inner loops costs little.

    python benchmarks/probes/kernel_spills.py [--march haswell,native]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sysconfig
import tempfile
from pathlib import Path

from torch.utils.cpp_extension import include_paths

from verispec.models import kernels

SOURCE = Path(kernels.__file__).with_name("kquant.cpp")
FUNCTION = re.compile(r"^(_Z\S*dot_tile\S*):")
DEMANGLED = re.compile(r"dot_tile_(\w+?)I?Li(\d+)E")  # e.g. dot_tile_q4k_avx2ILi1E…: kernel name and rows


def assembly(march: str, folder: Path) -> list[str]:
    """kquant.cpp compiled to assembly with the library's flags and -march=`march`."""
    flags = [flag for flag in kernels.FLAGS if not flag.startswith("-march=")] + [f"-march={march}"]
    headers = [f"-I{path}" for path in [*include_paths(), sysconfig.get_paths()["include"]]]
    out = folder / f"kquant-{march}.s"
    subprocess.run(["g++", *flags, "-std=c++17", "-fPIC", "-w", *headers, "-S", "-o", str(out), str(SOURCE)], check=True)
    return out.read_text().splitlines()


def spills(lines: list[str]) -> dict[str, tuple[int, int]]:
    """Per tile-kernel function (not inlined): (instructions, vector moves to or from the stack)."""
    counts, name = {}, None
    for line in lines:
        if match := FUNCTION.match(line):
            name = match.group(1)
            counts[name] = [0, 0]
        elif name and line.startswith("\t.cfi_endproc"):
            name = None
        elif name and line.startswith("\t") and not line.startswith("\t."):
            counts[name][0] += 1
            counts[name][1] += "(%rsp)" in line and ("ymm" in line or "zmm" in line)
    return {name: tuple(count) for name, count in counts.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--march", default="haswell,native", help="comma list of -march values")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        for march in args.march.split(","):
            print(f"-march={march}:")
            for name, (instructions, moved) in sorted(spills(assembly(march, Path(folder))).items()):
                match = DEMANGLED.search(name)
                label = f"{match.group(1)}, {match.group(2)} row(s)" if match else name[:40]
                print(f"  {label:<28} {instructions:5d} instructions, {moved:4d} vector moves to/from the stack")


if __name__ == "__main__":
    main()
