"""README's layout block names every folder and module of the package, and nothing else."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_readme_layout_lists_every_module():
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Layout", 1)[1].split("```", 2)[1]
    listed, stack = set(), []
    for line in block.splitlines():
        if not line.startswith("  "):  # the root line, src/verispec/
            continue
        depth = (len(line) - len(line.lstrip())) // 2 - 1  # two spaces per level under src/verispec/
        name = line.split()[0]
        stack[depth:] = [name.rstrip("/")]
        listed.add("/".join(stack) + ("/" if name.endswith("/") else ""))
    package = ROOT / "src" / "verispec"
    present = set()
    for path in package.rglob("*"):
        if "__pycache__" in path.parts or path.suffix in (".pyc",):
            continue
        relative = path.relative_to(package).as_posix()
        if path.is_dir():
            present.add(relative + "/")
        elif path.name != "__init__.py" or path.parent == package:
            present.add(relative)
    # leaf folders whose files are named in the folder's comment (kernels/, static/) count as listed
    present -= {p for p in present if re.match(r"(models/kernels|serving/http/static)/.", p)}
    assert listed == present, f"missing from README: {sorted(present - listed)}; not in the tree: {sorted(listed - present)}"
