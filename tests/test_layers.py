"""The package's layers (pyproject.toml's import-linter contract): no module imports one above it, inside
functions too, no two modules of a folder import each other (through others too), and every module is in a
layer. lint-imports is run as CI would run it, on this tree and on a copy with one import planted upward and
one circle planted inside a folder, which it must refuse."""

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from tests.pace import paced

REPO = Path(__file__).resolve().parents[1]
LINT = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
        "sys.exit(lint_imports_command())", "--no-cache"]


def lint(where: Path) -> subprocess.CompletedProcess:
    return subprocess.run(LINT, cwd=where, capture_output=True, text=True, timeout=paced(120), env={"PATH": "/usr/bin:/bin"})


def test_the_layers_hold_and_a_planted_upward_import_or_circle_breaks_them(tmp_path):
    done = lint(REPO)
    assert done.returncode == 0 and "5 kept, 0 broken" in done.stdout, done.stdout + done.stderr
    shutil.copytree(REPO / "launcher", tmp_path / "launcher", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    leaf = tmp_path / "launcher" / "checkpoint" / "files.py"  # a leaf of the checkpoint package reaching a command
    leaf.write_text(leaf.read_text() + "\n\ndef planted():\n    from launcher.export import main\n\n    return main\n")
    below = tmp_path / "launcher" / "slurm" / "sbatch.py"  # what the command imports, importing the command back
    below.write_text(below.read_text() + "\n\ndef planted():\n    from launcher.slurm.__main__ import main\n\n    return main\n")
    broken = lint(tmp_path)
    said = re.sub(r"\x1b\[[0-9;]*m", "", broken.stdout)
    assert broken.returncode == 1 and "3 kept, 2 broken" in said, broken.stdout + broken.stderr
    assert "launcher.checkpoint.files -> launcher.export" in said
    assert "No cycles are allowed in launcher.slurm" in said and ".sbatch -> .__main__" in said


def test_every_module_of_the_package_is_in_a_layer():
    layers = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]["layers"]
    named = {m.strip() for layer in layers for m in layer.split("|")}
    present = {f"launcher.{p.stem}" for p in (REPO / "launcher").glob("*.py") if p.stem != "__init__"}
    present |= {f"launcher.{p.parent.name}" for p in (REPO / "launcher").glob("*/__init__.py")}
    assert present - named == set(), "modules in no layer: add them to [tool.importlinter] in pyproject.toml"
    assert named - present == set()
