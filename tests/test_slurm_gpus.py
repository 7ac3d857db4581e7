"""GPUs handed out by Slurm's GRES reach the right rank: `place` on the local cluster's fake GPUs.

slurm/local/up.sh gives each node two fake GPUs (character devices that nothing opens, see up.sh),
so Slurm sets CUDA_VISIBLE_DEVICES in jobs the way it does on a GPU cluster. torch sees no GPU here,
so every task passes `place` the number of entries of its CUDA_VISIBLE_DEVICES as the GPU count
torch.cuda.device_count() would give, and prints what `place` returns next to what Slurm set.

What Slurm 22.05 sets on this cluster (TaskPlugin=task/none, so no device cgroup):
- CUDA_VISIBLE_DEVICES holds node-local GPU indices: n2's GPUs are /dev/launcher-fake-gpu2 and 3,
  yet its tasks see 0,1, as on a cluster whose nodes each have /dev/nvidia0 and /dev/nvidia1.
- GPU_DEVICE_ORDINAL and SLURM_STEP_GPUS equal CUDA_VISIBLE_DEVICES in every task.
- With --gpus-per-task=1 each task gets its own single GPU in CUDA_VISIBLE_DEVICES (0 for one, 1 for
  the other), not both 0: without a device cgroup nothing renumbers them.
"""

import json
import re
import sys

import pytest

from tests.conftest import REPO
from tests.slurm_cluster import slurm_cluster  # noqa: F401

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

SHOWN = ("CUDA_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "SLURM_GPUS_ON_NODE",
         "SLURMD_NODENAME", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID")

# Run by every task: one JSON line with the placement and the variables Slurm set.
PROBE = f"""
import dataclasses, json, os
from launcher.placement.scheduler import place
visible = len([v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()])
placement, notes = place(os.environ, "auto", visible)
env = {{k: os.environ[k] for k in {SHOWN!r} if k in os.environ}}
print("PROBE " + json.dumps({{"placement": dataclasses.asdict(placement), "env": env}}), flush=True)
"""


def gpus_per_node(cluster) -> int:
    out = cluster.run("scontrol", "show", "node", "-o", "n1").stdout
    match = re.search(r"\bGres=gpu:(\d+)", out)
    return int(match.group(1)) if match else 0


def run_probe(cluster, tmp_path, *sbatch: str) -> list:
    """Submit a job whose tasks each print one probe line; return them sorted by global rank."""
    if gpus_per_node(cluster) < 2:
        pytest.skip("the local Slurm cluster has no fake GPUs (mknod refused? see slurm/local/up.sh's output)")
    script = tmp_path / "probe.sbatch"
    directives = "".join(f"#SBATCH {arg}\n" for arg in (*sbatch, "--time=1", f"--chdir={REPO}"))
    # The submitting environment travels with the job: drop a torchrun protocol left in it, which
    # `place` would prefer to Slurm's variables.
    script.write_text(f"#!/bin/bash\n{directives}"
                      "unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE GROUP_RANK ACCELERATE_MIXED_PRECISION\n"
                      f"PROBE=$(cat <<'PY'\n{PROBE}\nPY\n)\n"
                      f'srun {sys.executable} -c "$PROBE"\n')
    out = tmp_path / "probe.out"
    job = cluster.sbatch(script, f"--output={out}")
    info = cluster.wait(job, timeout=120)  # a busy machine starts even a short job late
    said = out.read_text() if out.exists() else ""
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), f"{info}\n{said}"
    rows = [json.loads(line[len("PROBE "):]) for line in said.splitlines() if line.startswith("PROBE ")]
    return sorted(rows, key=lambda row: row["placement"]["rank"])


def test_gpus_per_node_each_rank_takes_its_local_rank(slurm_cluster, tmp_path):  # noqa: F811
    rows = run_probe(slurm_cluster, tmp_path, "--nodes=2", "--ntasks-per-node=2", "--gpus-per-node=2")

    places = [row["placement"] for row in rows]
    envs = [row["env"] for row in rows]
    assert [(p["rank"], p["node_rank"], p["local_rank"]) for p in places] == \
        [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)], rows
    assert all((p["world_size"], p["local_world_size"], p["launched_by"]) == (4, 2, "slurm") for p in places), rows
    assert [e["SLURMD_NODENAME"] for e in envs] == ["n1", "n1", "n2", "n2"], rows
    for p, e in zip(places, envs):
        assert (str(p["rank"]), str(p["local_rank"]), str(p["node_rank"])) == \
            (e["SLURM_PROCID"], e["SLURM_LOCALID"], e["SLURM_NODEID"]), (p, e)
        # Every task of a node sees both of its GPUs, by node-local index (n2's too).
        assert e["CUDA_VISIBLE_DEVICES"] == e["GPU_DEVICE_ORDINAL"] == e["SLURM_STEP_GPUS"] == "0,1", e
        assert e["SLURM_GPUS_ON_NODE"] == "2", e
        # ... and takes the one at its local rank.
        local = int(e["SLURM_LOCALID"])
        assert p["device"] == f"cuda:{local}", (p, e)
        assert p["gpu"] == e["CUDA_VISIBLE_DEVICES"].split(",")[local], (p, e)


def test_gpus_per_task_each_rank_sees_one_gpu_of_its_own(slurm_cluster, tmp_path):  # noqa: F811
    rows = run_probe(slurm_cluster, tmp_path, "--nodes=1", "--ntasks=2", "--gpus-per-task=1")

    places = [row["placement"] for row in rows]
    envs = [row["env"] for row in rows]
    assert [(p["rank"], p["node_rank"], p["local_rank"]) for p in places] == [(0, 0, 0), (1, 0, 1)], rows
    assert all((p["world_size"], p["local_world_size"], p["launched_by"]) == (2, 2, "slurm") for p in places), rows
    assert envs[0]["SLURMD_NODENAME"] == envs[1]["SLURMD_NODENAME"], rows
    for p, e in zip(places, envs):
        # One GPU per task, named the same by the three variables; the job holds both.
        assert re.fullmatch(r"\d+", e["CUDA_VISIBLE_DEVICES"]), e
        assert e["CUDA_VISIBLE_DEVICES"] == e["GPU_DEVICE_ORDINAL"] == e["SLURM_STEP_GPUS"], e
        assert e["SLURM_JOB_GPUS"] == "0,1", e
        # The only GPU a task sees is its cuda:0, whatever its local rank.
        assert (p["device"], p["gpu"]) == ("cuda:0", e["CUDA_VISIBLE_DEVICES"]), (p, e)
    # The two tasks got different GPUs: 0 and 1 (no cgroup renumbers each to 0).
    assert sorted(e["CUDA_VISIBLE_DEVICES"] for e in envs) == ["0", "1"], rows
