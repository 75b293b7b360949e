"""The import-linter layers contract (pyproject.toml) holds for the package and catches a new upward
import: a copy of the package with one planted import from a foundation module up to the CLI fails it."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint(source_root: Path) -> subprocess.CompletedProcess:
    """Run lint-imports with the project's contract on the package found under `source_root`."""
    env = {**os.environ, "PYTHONPATH": str(source_root)}
    return subprocess.run([str(LINT_IMPORTS), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
                          cwd=source_root, env=env, capture_output=True, text=True, timeout=300)


def test_the_package_keeps_its_layers():
    result = lint(ROOT / "src")
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_planted_upward_import_breaks_the_contract(tmp_path):
    shutil.copytree(ROOT / "src" / "verispec", tmp_path / "verispec",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    planted = tmp_path / "verispec" / "types.py"
    planted.write_text(planted.read_text() + "\nimport verispec.cli  # planted: a foundation importing the CLI\n")
    result = lint(tmp_path)
    assert result.returncode != 0, result.stdout
    assert "verispec.types -> verispec.cli" in result.stdout, result.stdout
