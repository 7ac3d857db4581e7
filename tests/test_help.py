"""The help a newcomer reads: every command and option with its meaning, and one line for a missing argument."""

import dataclasses
import subprocess
import sys

import pytest

from launcher.recipe.schema import SlurmConfig
from tests.conftest import REPO
from tests.pace import paced


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=paced(60))


def test_the_launchers_help_lists_the_commands_and_points_to_the_recipe_reference():
    done = run("launcher", "--help")
    assert done.returncode == 0
    for command in ("python -m launcher.slurm submit|render", "python -m launcher.export", "python -m launcher.bench"):
        assert command in done.stdout
    assert "docs/recipe.md" in done.stdout and "--print-config" in done.stdout


def test_no_recipe_says_a_recipe_is_required():
    done = run("launcher")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith(
        "launcher: a recipe file is required, e.g. python -m launcher recipes/quickstart.yaml"), done.stderr


@pytest.mark.parametrize("args", [["--help"], ["submit", "--help"], ["render", "-h"], ["render", "recipes/quickstart.yaml", "--help"]])
def test_slurm_help_lists_every_option_with_its_meaning(args):
    done = run("launcher.slurm", *args)
    assert done.returncode == 0, done.stdout + done.stderr
    for f in dataclasses.fields(SlurmConfig):
        line = next((l for l in done.stdout.splitlines() if l.strip().startswith(f"--{f.name.replace('_', '-')} ")), None)
        assert line is not None and len(line.split(None, 1)[1]) > 10, (f.name, done.stdout)
    assert "[default: 01:00:00]" in done.stdout and "[default: torchrun]" in done.stdout


def test_slurm_without_a_command_is_one_line():
    done = run("launcher.slurm")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "a command is required: submit or render" in done.stderr


@pytest.mark.slow  # over 3 s on a quiet machine: left out of the fast tier (-m 'not slow')
def test_a_script_with_a_bare_python_says_so_in_a_comment_and_beside_it():
    done = run("launcher.slurm", "render", "recipes/quickstart.yaml")
    assert done.returncode == 0
    assert "# this script runs a bare `python`" in done.stdout and "--python" in done.stdout
    assert "launcher.slurm: this script runs a bare `python`" in done.stderr
    named = run("launcher.slurm", "render", "recipes/quickstart.yaml", "--python", sys.executable)
    assert "bare" not in named.stdout + named.stderr
