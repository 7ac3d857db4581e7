"""The sbatch script is a pure function of typed options: checked against golden files."""

import os
import subprocess
from pathlib import Path

import pytest

from launcher.errors import UserError
from launcher.recipe.schema import SlurmConfig
from launcher.slurm.__main__ import main, parse
from launcher.slurm.render import render
from tests.pace import paced

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


@pytest.mark.parametrize("layout", ["torchrun", "srun"])
def test_a_job_array_task_names_itself_by_its_array_and_index(layout):
    """A sweep's or the replica groups' task is `<array job id>_<task id>` in squeue, scontrol and its log's name
    (%A_%a), not its own SLURM_JOB_ID: the line it starts with says that name. The script's lines that name the
    job, run in bash under the environment Slurm gives a task (no cluster)."""
    script = render(SlurmConfig(layout=layout), Path("/repo/recipes/quickstart.yaml"), [], Path("/repo/runs/q"), "q",
                    Path("/repo"))
    naming = [line for line in script.splitlines() if line.startswith(("job=", 'echo "launcher: job '))]
    env = {"PATH": os.environ["PATH"], "SLURM_JOB_ID": "107", "SLURM_JOB_NODELIST": "node1",
           "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "20107"}

    def said(**array: str) -> str:
        done = subprocess.run(["bash", "-euc", "\n".join(["head_addr=10.0.0.1 port=20107", *naming])],
                              env={**env, **array}, capture_output=True, text=True, timeout=paced(30))
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert said().startswith("launcher: job 107 (restart 0) on node1, ")
    assert said(SLURM_ARRAY_JOB_ID="100", SLURM_ARRAY_TASK_ID="7").startswith("launcher: job 100_7 (restart 0) on node1, ")


# A fault-tolerant run: the lighthouse's job and the groups' job array (launcher/slurm/groups.py).
FT = {"ft_lighthouse.sbatch": 0, "ft_groups_torchrun_2x4.sbatch": 1}


def _ft_scripts(section):
    from launcher.slurm import groups

    return groups.scripts(CASES["torchrun_2x4.sbatch"], section, Path("/repo/recipes/quickstart.yaml"),
                          ["fault_tolerance.groups=3", "trainer.max_steps=100"], Path("/repo/runs/quickstart"),
                          "quickstart", Path("/repo"))


@pytest.mark.parametrize("name", sorted(FT))
def test_replica_groups_render_a_lighthouse_job_and_a_job_array_matching_golden(name):
    from launcher.recipe.fault_tolerance import FaultToleranceConfig

    script = _ft_scripts(FaultToleranceConfig(groups=3))[FT[name]]
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(script)
    assert script == path.read_text(), f"rendered script differs from {path}; UPDATE_GOLDEN=1 rewrites it"


def test_replica_groups_with_a_lighthouse_named_render_the_groups_alone():
    from launcher.recipe.fault_tolerance import FaultToleranceConfig

    lighthouse, array = _ft_scripts(FaultToleranceConfig(groups=3, lighthouse="http://lh:29510"))
    assert lighthouse == "" and "#SBATCH --array=0-2" in array and "lighthouse.address" not in array


def test_replica_groups_on_the_command_line(capsys):
    assert main(["render", "recipes/quickstart.yaml", "--replica-groups", "2", "--python=/venv/bin/python"]) == 0
    out = capsys.readouterr().out
    heads = [line for line in out.splitlines() if line.startswith("# =====")]
    assert [h.rsplit("/", 1)[1] for h in heads] == ["lighthouse.sbatch =====", "groups.sbatch ====="]
    assert "--lighthouse --address-file" in out and "#SBATCH --array=0-1" in out
    assert "fault_tolerance.groups=2 run_dir=" in out and out.rstrip().endswith("/group_$SLURM_ARRAY_TASK_ID")
    assert main(["render", "recipes/quickstart.yaml", "--replica-groups", "0"]) == 2
    assert capsys.readouterr().err.strip() == \
        "launcher: --replica-groups 0: fault_tolerance.groups: must be 1 or more, got 0"
    assert main(["render", "recipes/quickstart.yaml", "--replica-groups", "2", "fault_tolerance.group=1"]) == 2
    assert capsys.readouterr().err.strip() == (
        "launcher: fault_tolerance.group: set to 1, but python -m launcher.slurm submits every group of the run (a "
        "job array, task g for group g); leave it out")
