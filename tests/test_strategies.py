"""One recipe, every strategy, the same weights: real processes (torchrun, gloo on the CPU)."""

import socket
import subprocess
import sys

import pytest

from tests.conftest import QUICKSTART, REPO, assert_same_weights, trained_here
from tests.pace import paced
from tests.rounding import assert_within_rounding, float64

pytestmark = pytest.mark.slow  # real torchrun / multi-process runs: python -m pytest -m 'not slow' skips them

# No dropout, no batch statistics; 32 steps per epoch, so 40 steps cross an epoch boundary with shuffling.
RECIPE = ["recipes/quickstart.yaml", "data.train.n=1024", "data.val.n=256", "data.batch_size=32",
          "trainer.max_steps=40", "trainer.log_every=10", "logging.tensorboard=false",
          "logging.memory_plan=false"]  # no planner process beside each run (tests/test_plan.py checks those)
# The runs compared with one process's: in float64, where rounding does not depend on the CPU (tests/rounding.py).
EXACT = [*RECIPE, *float64("recipes.components.mlp.MLP")]
STEPS = 40  # RECIPE's trainer.max_steps
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(command: list, timeout: float = 180) -> subprocess.CompletedProcess:
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=paced(timeout))
    assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The single-process run every strategy's must give: trained in this process."""
    folder = tmp_path_factory.mktemp("single")
    trained_here(*EXACT, f"run_dir={folder}", "strategy=single")
    return folder / "model.pt"


def assert_equivalent(reference, other) -> None:
    """`other`, a run of EXACT, ends as the one-process `reference` does, within rounding."""
    assert_within_rounding(reference, other, STEPS)


def test_dp_without_gpus_runs_as_single(reference, tmp_path):
    said = trained_here(*EXACT, f"run_dir={tmp_path}", "strategy=dp")  # a plain process, as this one
    assert "strategy: dp found no GPU; running as a single process on the CPU" in said
    assert_equivalent(reference, tmp_path / "model.pt")


@pytest.fixture(scope="module")
def ddp_torchrun(tmp_path_factory):
    """DDP x2 under torchrun, saving every 10 steps: test_ddp_under_torchrun's run, and the run no kill stopped
    that test_elastic_restart_resumes_and_finishes compares with (the saves change no weight)."""
    folder = tmp_path_factory.mktemp("ddp-torchrun")
    done = run([*TORCHRUN, "--standalone", "--nproc_per_node=2", "-m", "launcher", *EXACT, "checkpoint.every=10",
                f"run_dir={folder}"])
    return done, folder / "model.pt"


def test_ddp_under_torchrun(reference, ddp_torchrun):
    done, model = ddp_torchrun
    assert "(ddp)" in done.stdout and done.stdout.count("training quickstart") == 1  # rank 0 alone prints
    assert_equivalent(reference, model)


def test_ddp_started_by_the_launcher(reference, tmp_path):
    done = run([sys.executable, "-m", "launcher", *EXACT, f"run_dir={tmp_path}", "strategy=ddp", "nproc_per_node=2"])
    assert done.stdout.count("optimizer: torch.optim.AdamW with fused=True") == 1  # rank 0 says it; both chose it
    assert_equivalent(reference, tmp_path / "model.pt")


def test_ddp_compiled_gives_the_eager_single_weights(reference, tmp_path):
    run([sys.executable, "-m", "launcher", *EXACT, f"run_dir={tmp_path}", "strategy=ddp", "nproc_per_node=2",
         "trainer.compile=true"])
    assert_equivalent(reference, tmp_path / "model.pt")


def test_accelerate_two_processes(reference, tmp_path):
    pytest.importorskip("accelerate", reason="the accelerate extra is not installed")
    # On the CPU, accelerate's `--cpu` starts one process; its torchrun path (--multi_gpu) starts several.
    done = run([*ACCELERATE, "--multi_gpu", "--num_processes=2", "--num_machines=1", "--mixed_precision=no",
                "--dynamo_backend=no", f"--main_process_port={free_port()}",
                "-m", "launcher", *EXACT, f"run_dir={tmp_path}"])
    assert "(accelerate)" in done.stdout  # strategy auto picks accelerate under accelerate launch
    assert_equivalent(reference, tmp_path / "model.pt")


def test_two_nodes_one_process_each(reference, tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    agents = [subprocess.Popen(
        [*TORCHRUN, "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint={endpoint}",
         "--rdzv_id=equivalence", "-m", "launcher", *EXACT, f"run_dir={tmp_path}"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = [agent.communicate(timeout=paced(180))[0] for agent in agents]
    assert [a.returncode for a in agents] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    table = next(o for o in outputs if "training quickstart" in o)
    assert "1     0           1" in table  # rank 1 is local rank 0 on node 1
    assert_equivalent(reference, tmp_path / "model.pt")


def test_elastic_restart_resumes_and_finishes(tmp_path, ddp_torchrun):
    common = [*EXACT, "checkpoint.every=10"]
    dies = [*float64("tests.components.DiesOnce"), "model.at=25", "model.rank=1"]
    done = run([*TORCHRUN, "--standalone", "--nproc_per_node=2", "--max-restarts=1", "-m", "launcher", *common,
                *dies, f"run_dir={tmp_path / 'killed'}"])
    assert "resumed from" in done.stdout and "step_20" in done.stdout
    assert_same_weights(ddp_torchrun[1], tmp_path / "killed" / "model.pt")


def test_a_mistake_under_torchrun_exits_2_on_every_rank_with_one_line(tmp_path):
    done = subprocess.run([*TORCHRUN, "--standalone", "--nproc_per_node=2", "-m", "launcher", *RECIPE,
                           f"run_dir={tmp_path}", "trainer.max_step=3"], cwd=REPO, capture_output=True, text=True,
                          timeout=paced(120))
    assert done.returncode != 0
    line = "launcher: override 'trainer.max_step=3': trainer.max_step: unknown key; did you mean 'trainer.max_steps'?"
    said = [l for l in done.stderr.splitlines() if "launcher:" in l and not l.startswith(" ")]
    assert said == [line]  # the workers' own output: rank 0 once
    # torchrun's own report follows, indented; its root cause carries the line (the worker's error file)
    # instead of "To enable traceback see ...", and no frame of ours is in it
    assert "exitcode  : 2" in done.stderr and f"  traceback : {line}" in done.stderr
    assert str(REPO / "launcher") not in done.stderr


@pytest.mark.parametrize("env, recipe, expected, says", [
    ({}, ("fp32", 1), ("fp32", 1), []),
    ({"ACCELERATE_MIXED_PRECISION": "no"}, ("fp32", 1), ("fp32", 1), []),
    ({"ACCELERATE_MIXED_PRECISION": "bf16"}, ("fp32", 1), ("bf16", 1), ["accelerate launch sets mixed_precision bf16: it wins"]),
    ({"ACCELERATE_MIXED_PRECISION": "no"}, ("bf16", 1), ("bf16", 1), ["the recipe's precision bf16 wins"]),
    ({"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4"}, ("fp32", 2), ("fp32", 4), ["gradient_accumulation_steps 4: it wins"]),
])
def test_accelerate_settles_precision_and_accumulation(monkeypatch, env, recipe, expected, says):
    from launcher.placement.scheduler import Placement
    from launcher.strategies.accelerate import Accelerate

    for key in ("ACCELERATE_MIXED_PRECISION", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    precision, accum, notes = Accelerate(Placement()).settle(*recipe)
    assert (precision, accum) == expected
    assert len(notes) == len(says) and all(s in n for s, n in zip(says, notes))


def test_nproc_per_node_without_a_strategy_that_starts_processes_says_so(tmp_path):
    said = trained_here(str(QUICKSTART), f"run_dir={tmp_path}", "nproc_per_node=2", "trainer.max_steps=2")
    assert "nproc_per_node: 2 starts processes for strategy ddp or fsdp; strategy auto runs this one process" in said
