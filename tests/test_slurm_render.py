"""The sbatch script is a pure function of typed options: checked against golden files."""

import os
from pathlib import Path

import pytest

from launcher.errors import UserError
from launcher.recipe.schema import SlurmConfig
from launcher.slurm.__main__ import main, parse
from launcher.slurm.render import render

GOLDEN = Path(__file__).parent / "golden"
CASES = {
    "torchrun_2x4.sbatch": SlurmConfig(nodes=2, gpus_per_node=4, cpus_per_task=32, mem="200G", time="2-00:00:00",
                                       partition="gpu", account="lab", qos="high", python="/opt/venv/bin/python",
                                       sbatch=["--exclusive", "--constraint=h100"],
                                       setup=["module load cuda/12.4", "source /opt/venv/bin/activate"]),
    "srun_1x2_cpu.sbatch": SlurmConfig(layout="srun", tasks_per_node=2, job_name="tiny", signal_seconds=60,
                                       output="/logs/%x-%j.out", error="/logs/%x-%j.err"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_rendered_script_matches_golden(name):
    script = render(CASES[name], Path("/repo/recipes/quickstart.yaml"), ["trainer.max_steps=100", "optimizer.lr=3e-4"],
                    Path("/repo/runs/quickstart"), "quickstart", Path("/repo"))
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(script)
    assert script == path.read_text(), f"rendered script differs from {path}; UPDATE_GOLDEN=1 rewrites it"


def test_command_line_options_become_typed_overrides():
    command, recipe, slurm, training = parse(["submit", "r.yaml", "--nodes", "2", "--gpus-per-node=4",
                                              "--setup", "module load x", "--setup", "source 'a b'/activate",
                                              "trainer.max_steps=5"])
    assert (command, str(recipe), training) == ("submit", "r.yaml", ["trainer.max_steps=5"])
    assert slurm == ["slurm.nodes=2", "slurm.gpus_per_node=4",
                     "slurm.setup=['module load x', 'source \\'a b\\'/activate']"]


def test_unknown_option_lists_the_valid_ones():
    with pytest.raises(UserError, match=r"unknown option --node; valid: --nodes, --gpus-per-node, .*--setup"):
        parse(["render", "r.yaml", "--node", "2"])


def test_recipe_section_and_command_line_precedence(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text((Path(__file__).parents[1] / "recipes" / "quickstart.yaml").read_text()
                      + "slurm: {nodes: 3, partition: cpu, setup: ['echo from recipe']}\n")
    assert main(["render", str(recipe), "--nodes", "2", "--setup", "echo from flag"]) == 0
    script = capsys.readouterr().out
    assert "#SBATCH --nodes=2" in script and "#SBATCH --partition=cpu" in script
    assert "echo from flag" in script and "echo from recipe" not in script


def test_bad_values_name_the_flag(capsys):
    assert main(["render", "recipes/quickstart.yaml", "--nodes", "two"]) == 2
    assert capsys.readouterr().err.strip() == "launcher: --nodes two: expected an integer, got 'two'"
    assert main(["render", "recipes/quickstart.yaml", "--layout", "mpi", "--time", "soon"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == ["launcher: --layout mpi: got 'mpi'; valid: torchrun, srun",
                                "launcher: --time soon: got 'soon'; Slurm's forms: MM, HH:MM:SS, D-HH:MM:SS"]
