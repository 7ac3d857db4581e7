"""Fault tolerance's pieces without processes: the recipe section, which group a process is, the lighthouse,
each group's share of a batch, the fingerprint a joining group is checked against, the state it takes."""

import subprocess
import sys

import pytest
import torch

from launcher.errors import UserError
from launcher.ft import recovery, settings
from launcher.recipe import load
from launcher.recipe.fault_tolerance import FaultToleranceConfig
from launcher.strategies.base import Live
from tests.conftest import QUICKSTART, REPO, SMALL, launch


def problems(*overrides: str) -> str:
    with pytest.raises(UserError) as e:
        load(QUICKSTART, list(overrides))
    return "\n".join(e.value.problems)


def test_the_section_is_null_by_default_and_set_by_one_key():
    assert load(QUICKSTART).recipe.fault_tolerance is None
    section = load(QUICKSTART, ["fault_tolerance.groups=3"]).recipe.fault_tolerance
    assert (section.groups, section.group, section.lighthouse, section.min_groups) == (3, None, None, 1)
    assert (section.timeouts.pg, section.timeouts.quorum, section.timeouts.join) == (30, 60, 120)


@pytest.mark.parametrize("overrides, expected", [
    (["fault_tolerance.groups=2", "fault_tolerance.group=2"], "fault_tolerance.group: is an index among "
                                                              "fault_tolerance.groups=2 groups: 0 to 1, got 2"),
    (["fault_tolerance.groups=2", "fault_tolerance.min_groups=3"], "fault_tolerance.min_groups: must be at most "
                                                                   "fault_tolerance.groups (2), got 3"),
    (["fault_tolerance.groups=0"], "fault_tolerance.groups: must be 1 or more, got 0"),
    (["fault_tolerance.lighthouse=localhost:29510"], "fault_tolerance.lighthouse: must be the lighthouse's "
                                                     "http://host:port (an IPv6 host in brackets, "
                                                     "http://[::1]:29510), got 'localhost:29510'"),
    (["fault_tolerance.lighthouse=http://localhost:99999"], "fault_tolerance.lighthouse: the port of "
                                                            "'http://localhost:99999' must be 1 to 65535, got 99999"),
    (["fault_tolerance.lighthouse=http://[::1]:0"], "fault_tolerance.lighthouse: the port of 'http://[::1]:0' must be "
                                                    "1 to 65535, got 0"),
    (["fault_tolerance.lighthouse=http://::1:29510"], "fault_tolerance.lighthouse: must be the lighthouse's "
                                                      "http://host:port (an IPv6 host in brackets"),
    (["fault_tolerance.groups=2", "strategy=dp"], "strategy: fault_tolerance runs strategy single, ddp or fsdp inside "
                                                  "a group (auto picks single or ddp), got 'dp'"),
    (["fault_tolerance.groups=2", "strategy=fsdp", "parallel.pp=2"], "parallel.pp: fault_tolerance runs no pipeline "
                                                                     "stages inside a group (not built yet)"),
    (["fault_tolerance.timeouts.pg=-1"], "fault_tolerance.timeouts.pg: must be a positive number of seconds, got -1"),
])
def test_a_bad_value_is_one_line_naming_the_key(overrides, expected):
    said = problems(*overrides)
    assert expected in said and len(said.splitlines()) == 1, said


@pytest.mark.parametrize("overrides, order", [
    (["fault_tolerance.timeouts.pg=90"], "pg (90) < quorum (60) < join (120) < dist_timeout (600)"),
    (["fault_tolerance.timeouts.join=50"], "pg (30) < quorum (60) < join (50) < dist_timeout (600)"),
    (["fault_tolerance.timeouts.quorum=30"], "pg (30) < quorum (30) < join (120) < dist_timeout (600)"),
    (["dist_timeout=100"], "pg (30) < quorum (60) < join (120) < dist_timeout (100)"),
])
def test_the_timeouts_out_of_order_are_one_line_naming_them_in_order(overrides, order):
    said = problems("fault_tolerance.groups=2", *overrides)
    assert said.count("\n") == 0 and f"fault_tolerance.timeouts: must grow in this order, each longer than the one " \
                                      f"before: {order} does not" in said, said


def test_this_groups_index_from_the_key_else_the_environment():
    section = FaultToleranceConfig(groups=3)
    assert settings.group_index(section, {"REPLICA_GROUP_ID": "2"}) == 2
    assert settings.group_index(FaultToleranceConfig(groups=3, group=1), {"REPLICA_GROUP_ID": "2"}) == 1  # key wins
    for env, said in [({}, "fault_tolerance.group: not set, and REPLICA_GROUP_ID is not in the environment"),
                      ({"REPLICA_GROUP_ID": "3"}, "REPLICA_GROUP_ID='3' is not a group index of "
                                                  "fault_tolerance.groups=3: 0 to 2"),
                      ({"REPLICA_GROUP_ID": "one"}, "REPLICA_GROUP_ID='one' is not a group index")]:
        with pytest.raises(UserError, match=said):
            settings.group_index(section, env)


# What a pod's environment holds (docs/fault-tolerance.md#kubernetes): Kubernetes' JOB_COMPLETION_INDEX and
# HOSTNAME, JobSet's names where the manifest maps its labels, REPLICA_GROUP_ID where it maps the job index.
JOBSET = {"JOB_COMPLETION_INDEX": "0", "HOSTNAME": "train-groups-2-0"}


@pytest.mark.parametrize("env, group", [
    (JOBSET, 2),  # a group of one pod: job 2 of the replicated job "groups"
    ({"JOB_COMPLETION_INDEX": "1", "HOSTNAME": "my-run-7-groups-1-1"}, 1),  # a group's second node; names with '-'
    ({**JOBSET, "JOBSET_NAME": "train", "REPLICATED_JOB_NAME": "groups"}, 2),  # the names confirm it
    ({**JOBSET, "JOBSET_NAME": "train"}, 2),
    ({**JOBSET, "REPLICA_GROUP_ID": "0"}, 0),  # the label mapped by the Downward API wins
    ({"HOSTNAME": "train-groups-2-0"}, None),  # not an Indexed Job's pod: nothing read from the hostname
])
def test_a_jobset_pods_group_is_its_job_index(env, group):
    section = FaultToleranceConfig(groups=3)
    if group is None:
        with pytest.raises(UserError, match="REPLICA_GROUP_ID is not in the environment"):
            settings.group_index(section, env)
    else:
        assert settings.group_index(section, env) == group


@pytest.mark.parametrize("env, said", [
    ({"JOB_COMPLETION_INDEX": "0", "HOSTNAME": "train-groups-2-0-x7k2p"},  # DNS hostnames off: the pod's name
     "fault_tolerance.group: not set, and this pod of an Indexed Job (JOB_COMPLETION_INDEX='0') has "
     "HOSTNAME='train-groups-2-0-x7k2p', not a JobSet pod's <jobset>-<replicated job>-<job index>-0; set "
     "REPLICA_GROUP_ID from the label jobset.sigs.k8s.io/job-index by the Downward API "
     "(docs/fault-tolerance.md#kubernetes), or fault_tolerance.group"),
    ({**JOBSET, "HOSTNAME": "train-groups-2-1"}, "not a JobSet pod's <jobset>-<replicated job>-<job index>-0;"),
    ({**JOBSET, "JOBSET_NAME": "other", "REPLICATED_JOB_NAME": "groups"},  # a plain Indexed Job named like one
     "HOSTNAME='train-groups-2-0', not a JobSet pod's other-groups-<job index>-0;"),
    ({**JOBSET, "HOSTNAME": "train-groups-3-0"},
     "fault_tolerance.group: this JobSet pod's job index is 3 (HOSTNAME='train-groups-3-0'), not a group index of "
     "fault_tolerance.groups=3: 0 to 2; the replicated job's replicas must be fault_tolerance.groups"),
])
def test_a_pod_whose_group_cannot_be_read_is_one_line_saying_how_to_set_it(env, said):
    with pytest.raises(UserError) as e:
        settings.group_index(FaultToleranceConfig(groups=3), env)
    assert said in str(e.value) and "\n" not in str(e.value)


def test_the_lighthouse_from_the_key_else_the_environment():
    section = FaultToleranceConfig()
    assert settings.lighthouse_address(section, {"TORCHFT_LIGHTHOUSE": "http://a:1"}) == "http://a:1"
    assert settings.lighthouse_address(FaultToleranceConfig(lighthouse="http://b:2"), {"TORCHFT_LIGHTHOUSE": "http://a:1"}) == "http://b:2"
    with pytest.raises(UserError, match="fault_tolerance.lighthouse: not set, and TORCHFT_LIGHTHOUSE is not in"):
        settings.lighthouse_address(section, {})
    with pytest.raises(UserError, match="TORCHFT_LIGHTHOUSE='a:1': must be the lighthouse's http://host:port"):
        settings.lighthouse_address(section, {"TORCHFT_LIGHTHOUSE": "a:1"})
    with pytest.raises(UserError, match="TORCHFT_LIGHTHOUSE='http://a:65536': the port of 'http://a:65536' must be 1 "
                                        "to 65535, got 65536"):
        settings.lighthouse_address(section, {"TORCHFT_LIGHTHOUSE": "http://a:65536"})
    for address in ("http://[::1]:29510", "https://[fe80::1]:1", "http://host.example:65535/", "http://10.0.0.1"):
        assert settings.lighthouse_address(section, {"TORCHFT_LIGHTHOUSE": address}) == address
        assert settings.lighthouse_address(FaultToleranceConfig(lighthouse=address), {}) == address


def test_each_group_reads_its_own_share_whatever_is_live():
    # groups of one process: group g is rank g of N; of two processes: ranks 2g and 2g+1 of 2N
    assert [settings.share(g, 3, (1, 0)) for g in range(3)] == [(3, 0), (3, 1), (3, 2)]
    assert [settings.share(g, 2, (2, r)) for g in range(2) for r in range(2)] == [(4, 0), (4, 1), (4, 2), (4, 3)]


def test_the_fingerprint_holds_what_shapes_training_and_names_what_differs():
    base = load(QUICKSTART, ["fault_tolerance.groups=2"]).config
    mine = settings.fingerprint(base, 1)
    assert mine["seed"] == 0 and mine["model.hidden"] == 128 and mine[settings.PROCESSES] == 1
    elsewhere = load(QUICKSTART, ["fault_tolerance.groups=2", "run_dir=/elsewhere", "logging.tensorboard=false",
                                  "fault_tolerance.timeouts.join=200", "checkpoint.every=7"]).config
    assert settings.fingerprint(elsewhere, 1) == mine  # where it writes, how it logs and waits: not training
    other = settings.fingerprint(load(QUICKSTART, ["fault_tolerance.groups=2", "seed=1", "model.hidden=64"]).config, 1)
    assert settings.differences(mine, other) == ["model.hidden (128 here, 64 in the live groups)",
                                                 "seed (0 here, 1 in the live groups)"]
    assert settings.differences(mine, settings.fingerprint(base, 2)) == [
        "processes per group (1 here, 2 in the live groups)"]
    # how a group's processes hold the model: rank r of each group averages its shards with rank r of the others
    sharded = load(QUICKSTART, ["fault_tolerance.groups=2", "strategy=fsdp", "parallel.tp=2"]).config
    assert settings.differences(settings.fingerprint(sharded, 2, "shards of dp_shard 1 x tp 2"),
                                settings.fingerprint(base, 2)) == [
        "model per process ('shards of dp_shard 1 x tp 2' here, 'whole' in the live groups)"]


def _live(seed: int, step: int) -> Live:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, 2)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    schedule.step()

    class Precision:
        def state_dict(self):
            return {"scale": seed}

        def load_state_dict(self, state):
            self.loaded = state

    class Position:
        def __init__(self):
            self.step, self.epoch, self.batch = step, 1, step

    return Live(model, optimizer, schedule, Precision(), Position(), None, print)


def test_a_joining_group_takes_the_live_groups_state_exactly():
    giver, taker = _live(0, 17), _live(1, 0)
    fingerprint = {"seed": 0}
    state = recovery.given(giver, fingerprint)
    drawn = torch.rand(3)  # the giver's RNG, as it stood when it gave, is the taker's next
    recovery.take(state, taker, fingerprint)
    for a, b in zip(giver.model.state_dict().values(), taker.model.state_dict().values()):
        assert torch.equal(a, b)
    assert str(taker.optimizer.state_dict()) == str(giver.optimizer.state_dict())
    assert taker.schedule.state_dict() == giver.schedule.state_dict() and taker.precision.loaded == {"scale": 0}
    assert (taker.position.step, taker.position.epoch, taker.position.batch) == (17, 1, 17)
    assert torch.equal(torch.rand(3), drawn)


def test_a_group_asked_for_its_state_during_a_step_hands_over_the_steps_start():
    # An optimistic quorum (launcher/ft/rounds.py) asks the giver during its step's forward: the batch read and the
    # draws made since its start are not handed over, the position and RNG as they stood at its start are
    giver, taker = _live(0, 17), _live(1, 0)
    at = recovery.boundary(giver)
    drawn = torch.rand(3)  # the step's draws (dropout), and its batch read, after its start
    giver.position.batch += 1
    recovery.take(recovery.given(giver, {"seed": 0}, at), taker, {"seed": 0})
    assert (taker.position.step, taker.position.epoch, taker.position.batch) == (17, 1, 17)
    assert torch.equal(torch.rand(3), drawn)  # the taker draws what the giver drew in the step


@pytest.fixture
def one_process_group():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _sharded(seed: int, steps: int) -> Live:
    """A live state whose weights and optimizer state are DTensors (FSDP2 on a mesh of this one process)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    fully_shard(model[0])
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(steps):
        model(torch.randn(5, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    live = _live(seed, steps)
    live.model, live.optimizer, live.schedule = model, optimizer, None
    return live


def test_a_joining_group_takes_each_shard_in_place_of_its_own(one_process_group):
    import io

    from torch.distributed._serialization import _streaming_load, _streaming_save
    from torch.distributed.tensor import DTensor

    giver, taker = _sharded(0, 2), _sharded(1, 0)  # the taker's optimizer has no state yet
    given = recovery.given(giver, {"seed": 0})
    # Each shard goes as a plain tensor (torchft moves plain tensors to the host), not with the giver's mesh: the
    # taker puts it on its own
    leaves = []
    torch.utils._pytree.tree_map(leaves.append, given)
    assert leaves and not any(isinstance(leaf, DTensor) for leaf in leaves)
    sent = io.BytesIO()
    _streaming_save(given, sent)  # as torchft's HTTP transfer sends it
    sent.seek(0)
    recovery.take(_streaming_load(sent, weights_only=False), taker, {"seed": 0})
    for a, b in zip(giver.model.parameters(), taker.model.parameters()):
        assert isinstance(b, DTensor) and b.placements == a.placements and torch.equal(a.to_local(), b.to_local())
    theirs, mine = giver.optimizer.state_dict()["state"], taker.optimizer.state_dict()["state"]
    assert theirs.keys() == mine.keys()
    for i in theirs:
        for key in ("exp_avg", "exp_avg_sq"):
            assert isinstance(mine[i][key], DTensor) and torch.equal(theirs[i][key].to_local(), mine[i][key].to_local())
    x = torch.randn(5, 4)
    for live in (giver, taker):  # and they train on alike
        live.model(x).sum().backward()
        live.optimizer.step()
    for a, b in zip(giver.model.parameters(), taker.model.parameters()):
        assert torch.equal(a.to_local(), b.to_local())


def test_a_joining_group_with_another_recipe_refuses_before_taking_anything():
    giver, taker = _live(0, 17), _live(1, 0)
    before = [t.clone() for t in taker.model.state_dict().values()]
    with pytest.raises(UserError, match=r"fault_tolerance: this group's recipe differs from the live groups' in "
                                        r"seed \(1 here, 0 in the live groups\); a group joins only a run of the same "
                                        r"recipe, and this one was not averaged in"):
        recovery.take(recovery.given(giver, {"seed": 0}), taker, {"seed": 1})
    assert all(torch.equal(a, b) for a, b in zip(before, taker.model.state_dict().values()))
    assert taker.position.step == 0


@pytest.mark.slow  # over 3 s on a quiet machine: left out of the fast tier (-m 'not slow')
def test_a_run_without_the_section_never_imports_torchft(tmp_path):
    code = ("import sys\nfrom launcher.recipe import load\nfrom launcher.run.train import train\n"
            f"train(load({str(QUICKSTART)!r}, {[*SMALL, 'trainer.max_steps=2', f'run_dir={tmp_path}']!r}))\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torchft' or m.startswith('launcher.ft')"
            " or m == 'launcher.strategies.fault_tolerant'))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("overrides, env, said", [
    (["fault_tolerance.groups=2"], {},
     "launcher: fault_tolerance.group: not set, and REPLICA_GROUP_ID is not in the environment; set "
     "fault_tolerance.group=<0 to 1>, or start the groups with python -m launcher.ft, which gives each its own"),
    (["fault_tolerance.groups=2", "fault_tolerance.lighthouse=http://127.0.0.1:9"], {"REPLICA_GROUP_ID": "1"},
     "launcher: fault_tolerance.lighthouse: nothing answers at http://127.0.0.1:9 (Connection refused); start the "
     "lighthouse first (python -m launcher.ft starts one and gives its address), or fix the address"),
    (["fault_tolerance.groups=2", "fault_tolerance.lighthouse=http://[::1]:9"], {"REPLICA_GROUP_ID": "1"},
     "launcher: fault_tolerance.lighthouse: nothing answers at http://[::1]:9 (Connection refused); start the "
     "lighthouse first (python -m launcher.ft starts one and gives its address), or fix the address"),
    (["fault_tolerance.groups=2", "fault_tolerance.lighthouse=http://localhost:99999"], {"REPLICA_GROUP_ID": "1"},
     "launcher: override 'fault_tolerance.lighthouse=http://localhost:99999': fault_tolerance.lighthouse: the port of "
     "'http://localhost:99999' must be 1 to 65535, got 99999"),
])
def test_a_group_without_its_index_or_its_lighthouse_stops_in_one_line(tmp_path, overrides, env, said):
    done = launch(str(QUICKSTART), *SMALL, f"run_dir={tmp_path}", *overrides,
                  env={k: v for k, v in env.items()} | {"TORCHFT_LIGHTHOUSE": ""})
    assert done.returncode == 2 and done.stderr.splitlines() == [said], done.stderr
