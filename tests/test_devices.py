"""Placement from the environment: a pure function, tested with tables."""

import re
import signal
from pathlib import Path

import pytest

from launcher.errors import UserError
from launcher.placement.scheduler import Placement, place
from tests.conftest import launch

# What torchrun sets for a worker (among others).
TORCHRUN = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize("env, devices, gpus, expected", [
    ({}, "cpu", 0, Placement()),
    ({}, "cpu", 2, Placement()),
    ({}, "auto", 0, Placement()),
    ({}, "auto", 1, Placement(device="cuda:0", gpu="0")),
    ({"CUDA_VISIBLE_DEVICES": "GPU-1234abcd"}, "auto", 1, Placement(device="cuda:0", gpu="GPU-1234abcd")),
    ({"CUDA_VISIBLE_DEVICES": "5,7"}, "cuda:1", 2, Placement(device="cuda:1", gpu="7")),
    ({"CUDA_VISIBLE_DEVICES": "MIG-a1b2"}, "cuda", 1, Placement(device="cuda:0", gpu="MIG-a1b2")),
    (TORCHRUN, "cpu", 0, Placement(3, 1, 4, 2, 1, "cpu", None, "torchrun")),
    ({**TORCHRUN, "CUDA_VISIBLE_DEVICES": "2,3"}, "auto", 2, Placement(3, 1, 4, 2, 1, "cuda:1", "3", "torchrun")),
    ({**TORCHRUN, "CUDA_VISIBLE_DEVICES": "3"}, "cuda", 1, Placement(3, 1, 4, 2, 1, "cuda:0", "3", "torchrun")),
])
def test_placement_table(env, devices, gpus, expected):
    placement, _ = place(env, devices, gpus)
    assert placement == expected


@pytest.mark.parametrize("env, devices, gpus, message", [
    ({}, "cuda", 0, "devices: 'cuda' asks for a GPU but none is visible (CUDA_VISIBLE_DEVICES unset"),
    ({"CUDA_VISIBLE_DEVICES": ""}, "cuda:0", 0, "none is visible (CUDA_VISIBLE_DEVICES=''"),
    ({}, "cuda:2", 2, "devices: cuda:2 is not visible; this process sees 2 GPU(s), cuda:0 to cuda:1"),
    ({**TORCHRUN, "LOCAL_RANK": "2"}, "auto", 2, "local rank 2 has no GPU: this process sees 2"),
    ({**TORCHRUN, "RANK": "x"}, "cpu", 0, "environment variable RANK='x' is not a non-negative integer"),
    ({**TORCHRUN, "RANK": "4"}, "cpu", 0, "RANK=4 must be below WORLD_SIZE=4"),
    # Set by hand, wrong or partial: one line naming the variable, never a silent single-process run.
    ({"RANK": "1"}, "cpu", 0, "environment: RANK=1 is set but WORLD_SIZE is not; torchrun sets both"),
    ({"WORLD_SIZE": "2"}, "cpu", 0, "environment: WORLD_SIZE=2 is set but RANK is not"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, "cpu", 0, "WORLD_SIZE=2 says several processes, but MASTER_ADDR and "
                                                 "MASTER_PORT are not set"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, "cpu", 0, "but MASTER_PORT is not set"),
    ({**TORCHRUN, "MASTER_PORT": "http"}, "cpu", 0, "MASTER_PORT='http' is not a port number (1 to 65535)"),
    ({**TORCHRUN, "MASTER_PORT": "70000"}, "cpu", 0, "MASTER_PORT='70000' is not a port number"),
    ({"ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_USE_CPU": "maybe"}, "auto", 0,
     "ACCELERATE_USE_CPU='maybe' is not a truth value; valid: y, yes, t, true, on, 1 or n, no, f, false, off, 0"),
    ({"ACCELERATE_USE_CPU": "2"}, "cpu", 0, "ACCELERATE_USE_CPU='2' is not a truth value"),
    # accelerate launch --num_processes 2 without --multi_gpu on a CPU: its one-process path, with the rendezvous
    # it sets for several (accelerate.utils.launch.prepare_simple_launcher_cmd_env); --cpu alike
    ({"ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_USE_CPU": "False", "MASTER_ADDR": "127.0.0.1",
      "MASTER_PORT": "29500"}, "auto", 0, "accelerate launch started one process where its --num_processes asked "
                                          "for several"),
    ({"ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_USE_CPU": "True", "MASTER_ADDR": "127.0.0.1",
      "MASTER_PORT": "29500"}, "auto", 0, "add --multi_gpu (on the CPU too)"),
])
def test_placement_errors_name_the_variable(env, devices, gpus, message):
    with pytest.raises(UserError) as info:
        place(env, devices, gpus)
    assert message in str(info.value)


def test_auto_without_a_gpu_says_so_in_one_line():
    placement, notes = place({}, "auto", 0)
    assert placement.device == "cpu" and len(notes) == 1 and "training on the CPU" in notes[0]


@pytest.mark.slow  # over 3 s on a quiet machine: left out of the fast tier (-m 'not slow')
def test_cuda_without_a_gpu_exits_2(tmp_path):
    done = launch("recipes/quickstart.yaml", "devices=cuda", f"run_dir={tmp_path}",
                  env={"CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 2
    assert done.stderr.startswith("launcher: devices: 'cuda' asks for a GPU but none is visible")
    assert len(done.stderr.splitlines()) == 1


SLURM = {"SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
         "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}


@pytest.mark.parametrize("env, devices, gpus, expected", [
    (SLURM, "cpu", 0, Placement(3, 1, 4, 2, 1, "cpu", None, "slurm")),
    ({**SLURM, "CUDA_VISIBLE_DEVICES": "6"}, "auto", 1, Placement(3, 1, 4, 2, 1, "cuda:0", "6", "slurm")),  # --gpus-per-task
    ({**SLURM, "CUDA_VISIBLE_DEVICES": "0,1"}, "auto", 2, Placement(3, 1, 4, 2, 1, "cuda:1", "1", "slurm")),  # --gpus-per-node
    ({**SLURM, "SLURM_STEP_TASKS_PER_NODE": "3,1", "SLURM_PROCID": "3", "SLURM_LOCALID": "0"}, "cpu", 0,
     Placement(3, 0, 4, 1, 1, "cpu", None, "slurm")),
    ({**TORCHRUN, **SLURM}, "cpu", 0, Placement(3, 1, 4, 2, 1, "cpu", None, "torchrun")),  # torchrun inside srun
    ({"ACCELERATE_MIXED_PRECISION": "no"}, "auto", 0, Placement(launched_by="accelerate")),
    ({**TORCHRUN, "ACCELERATE_MIXED_PRECISION": "bf16"}, "cpu", 0, Placement(3, 1, 4, 2, 1, "cpu", None, "accelerate")),
    ({"ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_USE_CPU": "True"}, "auto", 2, Placement(launched_by="accelerate")),
    ({"ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_USE_CPU": "on"}, "auto", 2, Placement(launched_by="accelerate")),
    ({"ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_USE_CPU": "False"}, "auto", 1,
     Placement(device="cuda:0", gpu="0", launched_by="accelerate")),
    ({"RANK": "0", "WORLD_SIZE": "1"}, "cpu", 0, Placement(launched_by="torchrun")),  # one process needs no rendezvous
])
def test_placement_under_slurm_and_accelerate(env, devices, gpus, expected):
    assert place(env, devices, gpus)[0] == expected


FREE = [("0", 1000), ("1", 30000), ("2", 30000), ("3", 5000)]


@pytest.mark.parametrize("devices, env, expected", [
    ("auto", {}, None),
    ("cuda", {}, None),
    ("auto:2", {}, "1,2"),  # most free memory; ties by index
    ("auto:3", {}, "1,2,3"),
    ([0, 3], {}, "0,3"),
    ([3], {"CUDA_VISIBLE_DEVICES": "3"}, "3"),
])
def test_gpu_selection(devices, env, expected):
    from launcher.placement.scheduler import select_gpus

    gpus = [g for g in FREE if "CUDA_VISIBLE_DEVICES" not in env or g[0] in env["CUDA_VISIBLE_DEVICES"].split(",")]
    assert select_gpus(devices, env, lambda: gpus) == expected


@pytest.mark.parametrize("devices, gpus, message", [
    ("auto:5", FREE, "devices: auto:5 asks for 5 GPU(s), visible: 0, 1, 2, 3"),
    ("auto:1", [], "devices: auto:1 asks for 1 GPU(s), visible: none"),
    ([0, 7], FREE, "devices: GPU 7 of [0, 7] is not there; visible: 0, 1, 2, 3"),
])
def test_gpu_selection_errors(devices, gpus, message):
    from launcher.placement.scheduler import select_gpus

    with pytest.raises(UserError, match=re.escape(message)):
        select_gpus(devices, {}, lambda: gpus)


def test_without_accelerate_installed_exit_2_with_the_install_command(tmp_path):
    fake = tmp_path / "accelerate"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('accelerate is not installed here')\n")
    done = launch("recipes/quickstart.yaml", "strategy=accelerate", f"run_dir={tmp_path / 'run'}",
                  env={"PYTHONPATH": str(tmp_path)})
    assert done.returncode == 2
    assert done.stderr.strip() == ("launcher: strategy: accelerate needs the accelerate package: "
                                   "pip install 'launcher[accelerate]' (or pip install accelerate)")


@pytest.mark.parametrize("nproc, gpus, device, cpus, expected", [
    (None, 4, "cuda:0", 2, 4),  # one process per visible GPU
    (2, 4, "cuda:0", 1, 2),  # on GPUs the cores do not limit
    (2, 0, "cpu", 2, 2),
    (1, 0, "cpu", 1, 1),
])
def test_process_count(nproc, gpus, device, cpus, expected):
    from launcher.placement.spawn import process_count

    assert process_count(nproc, gpus, device, cpus) == expected


@pytest.mark.parametrize("nproc, gpus, device, cpus, message", [
    (None, 0, "cpu", 2, "nproc_per_node: strategy=ddp on the CPU starts torchrun for you and needs a process count"),
    (100, 0, "cpu", 2, "nproc_per_node: 100 processes on the CPU, but this process may use 2 CPU core(s) "
                       "(os.sched_getaffinity); each process needs a core of its own: use nproc_per_node=2 or fewer"),
    (3, 2, "cuda:0", 64, "nproc_per_node: 3 processes, but this process sees 2 GPU(s) and strategy=ddp trains one process "
                         "per GPU; use nproc_per_node=2 or fewer"),
])
def test_process_count_refuses_more_than_the_machine_holds(nproc, gpus, device, cpus, message):
    from launcher.placement.spawn import process_count

    with pytest.raises(UserError) as info:
        process_count(nproc, gpus, device, cpus)
    assert message in str(info.value)


def test_fsdp_with_ep_and_no_process_count_names_fsdp_and_the_count_its_layout_takes(capsys):
    """strategy=fsdp parallel.ep=2 on the CPU without nproc_per_node: one line naming fsdp (it named ddp) and the
    count the layout takes; a plain fsdp names fsdp too."""
    from launcher.cli import main

    assert main(["recipes/quickstart.yaml", "strategy=fsdp", "parallel.ep=2", "parallel.tp=2", "devices=cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["launcher: nproc_per_node: strategy=fsdp on the CPU starts torchrun for you and needs a process "
                   "count; add nproc_per_node=4 or a multiple of 4 (parallel.tp=2 parallel.ep=2 lays ranks out in "
                   "groups of 4), or start it with torchrun --nproc_per_node=4 -m launcher ..."], err
    assert main(["recipes/quickstart.yaml", "strategy=fsdp", "devices=cpu"]) == 2
    assert capsys.readouterr().err.strip() == (
        "launcher: nproc_per_node: strategy=fsdp on the CPU starts torchrun for you and needs a process count; add "
        "nproc_per_node=N, or start it with torchrun --nproc_per_node=N -m launcher ...")



def _signal(sig):
    from torch.distributed.elastic.multiprocessing.api import SignalException

    return SignalException(f"Process 670 got signal: {int(sig)}", sigval=sig)


def _signal_raised(args):
    raise _signal(signal.SIGINT)


def _signalled_inside_torchs_metrics_wrapper(args):
    """What torch 2.13's torchrun raised in CI when SIGTERM landed on `start = time.time()` in its metrics
    wrapper: the wrapper's `finally` read `start` and raised UnboundLocalError while handling the signal."""
    try:
        raise _signal(signal.SIGTERM)
    finally:
        raise UnboundLocalError("cannot access local variable 'start' where it is not associated with a value")


def _a_bug_of_its_own(args):
    raise UnboundLocalError("no signal here")


@pytest.mark.parametrize("raised, expected", [(_signal_raised, 130), (_signalled_inside_torchs_metrics_wrapper, 143)])
def test_a_signal_torchrun_raised_however_wrapped_exits_128_plus_n(monkeypatch, raised, expected):
    import torch.distributed.run

    from launcher.placement import spawn
    from launcher.stopping import PARENT

    monkeypatch.setattr(torch.distributed.run, "run", raised)
    monkeypatch.setenv(PARENT, "1")  # restored after the test: torchrun() sets it
    assert spawn.torchrun(Path("recipes/quickstart.yaml"), [], 2) == expected


def test_a_bug_inside_torchrun_keeps_its_traceback(monkeypatch):
    import torch.distributed.run

    from launcher.placement import spawn
    from launcher.stopping import PARENT

    monkeypatch.setattr(torch.distributed.run, "run", _a_bug_of_its_own)
    monkeypatch.setenv(PARENT, "1")
    with pytest.raises(UnboundLocalError, match="no signal here"):
        spawn.torchrun(Path("recipes/quickstart.yaml"), [], 2)
