import getpass
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from tests.pace import paced
from tests.slurm_cluster import slurm_session  # noqa: F401  (one cluster for the session, whichever module asks)

# One intra-op thread: the machines running the tests are small and shared, and two spinning
# OpenMP threads competing with another process make a tiny model a hundred times slower.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Models and configs come from folders the tests write: nothing is ever fetched from the HF Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Inductor's on-disk cache is keyed by the code it compiles, not by ATEN_CPU_CAPABILITY: a kernel compiled under one
# capability (AVX-512) is loaded under another (ATEN_CPU_CAPABILITY=avx2, how the exactness tests are checked on one
# machine: docs/contributing.md), and its results are garbage (nan; a loss 10 times off). One cache per capability,
# for this process and the ones it starts.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{torch.backends.cpu.get_cpu_capability().lower()}"))

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "recipes" / "quickstart.yaml"

# A quickstart run small enough for a test: 32 steps per epoch, no files beyond the checkpoints, and no memory
# planner beside it (a process of its own, ~3 CPU s a run: tests/test_plan.py checks the runs that plan).
SMALL = [
    "data.train.n=1024", "data.val.n=256", "data.batch_size=32", "trainer.max_steps=80",
    "trainer.log_every=10", "trainer.eval_every=null", "checkpoint.every=null",
    "logging.tensorboard=false", "logging.progress_bar=false", "logging.memory_plan=false",
]


def pytest_sessionstart(session):
    """Each process that runs tests (each pytest-xdist worker, or pytest alone) starts its fork server
    (tests/fork_server/): the `python -m launcher` and torchrun processes its tests start are forked from a process
    that imported torch once. Asked for by LAUNCHER_TEST_FORK_SERVER=1 (not yet the default: see
    docs/contributing.md)."""
    config = session.config
    controller = getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput")
    if controller or os.environ.get("LAUNCHER_TEST_FORK_SERVER") != "1":
        return
    global _FORK_SERVER
    path = os.path.join(tempfile.mkdtemp(prefix="launcher-fork-"), "socket")
    here = REPO / "tests" / "fork_server"
    _FORK_SERVER = subprocess.Popen([sys.executable, str(here / "server.py"), path], stdout=subprocess.DEVNULL,
                                    start_new_session=True, env={k: v for k, v in os.environ.items()
                                                                 if k != "LAUNCHER_TEST_FORK_SERVER"})
    os.environ["LAUNCHER_TEST_FORK_SERVER"] = path  # until it listens, processes start as usual
    os.environ["PYTHONPATH"] = os.pathsep.join([str(here), *filter(None, [os.environ.get("PYTHONPATH")])])


_FORK_SERVER = None


def pytest_sessionfinish(session):
    if _FORK_SERVER is not None:
        import shutil

        _FORK_SERVER.terminate()
        _FORK_SERVER.wait()
        shutil.rmtree(os.path.dirname(_FORK_SERVER.args[-1]), ignore_errors=True)


@pytest.fixture
def own_processes(monkeypatch):
    """The processes this test starts start as a user's do, not from the fork server: for a test that reaches
    into the process tree (a rank stopped with SIGSTOP, workers found as a pid's children)."""
    monkeypatch.delenv("LAUNCHER_TEST_FORK_SERVER", raising=False)


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch, tmp_path_factory):
    monkeypatch.chdir(REPO)
    # the text data's token cache of each test its own, never the user's ~/.cache (processes a test starts too)
    monkeypatch.setenv("LAUNCHER_CACHE", str(tmp_path_factory.mktemp("launcher-cache")))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def one_rank(monkeypatch):
    """This process as rank 0 of a torchrun world of one: strategies ddp and fsdp run in-process."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for var, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(var, value)


def train(run_dir: Path, *overrides: str, recipe: Path = QUICKSTART) -> dict:
    """Train in this process (fast: torch is already imported) and return the last logged values."""
    from launcher.recipe import load
    from launcher.run.train import train as run

    return run(load(recipe, [*SMALL, f"run_dir={run_dir}", *overrides]))


def launch(*args: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m launcher ARGS` in a fresh process, as a user types it."""
    return subprocess.run([sys.executable, "-m", "launcher", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=paced(timeout), env={**os.environ, **(env or {})})


def in_this_process(*args: str) -> tuple:
    """`python -m launcher ARGS` in this process, where torch is imported already, for a run whose process is not
    what its test checks (a reference, a resume): (its exit code, what it printed on stdout, on stderr)."""
    import contextlib
    import io

    from launcher.cli import main

    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        patch.chdir(REPO)
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def trained_here(*args: str) -> str:
    """in_this_process for a run that must end well (a reference, a resume): what it printed."""
    code, out, err = in_this_process(*args)
    assert code == 0, (out + err)[-3000:]
    return out


def state_dict(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_same_weights(a: Path, b: Path) -> None:
    sa, sb = state_dict(a), state_dict(b)
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), f"{key} differs between {a} and {b}"


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups off the items
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (`-n 3 --dist loadgroup`) every Slurm test runs on one worker: they share one
    local cluster, which one process starts. The tests that measure (marked `measuring`) run on one worker
    too, one after another. So do a module's tests that share a module-scoped fixture
    (a reference run): spread over the workers, each would run it again."""
    sharing = {item.module.__name__ for item in items if _uses_a_module_fixture(item)}
    for item in items:
        if item.get_closest_marker("slurm"):
            _group(config, item, "slurm")
        elif item.get_closest_marker("measuring"):  # not two at once: each would load the CPU the other measures
            _group(config, item, "measuring")
        elif item.module.__name__ in sharing:  # the whole module, in a row: pytest ends a module's fixtures
            _group(config, item, item.module.__name__)  # when it moves to another module
    if getattr(config.option, "loadgroup", False):
        # loadgroup hands out the groups first (most tests first), then single tests in this order: the slow
        # ones before the quick, so that the run does not end on one worker's long test while the other idles
        items.sort(key=lambda item: not (item.get_closest_marker("slow") or item.get_closest_marker("xdist_group")))


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # before pytest-xdist's own (loadgroup's scheduler)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadgroup with a worker kept for the Slurm jobs, which mostly wait (tests/scheduling.py)."""
    if config.getvalue("dist") == "loadgroup":
        from tests.scheduling import WaitingApart

        return WaitingApart(config, log)
    return None


def pytest_collection_finish(session):
    """What collecting imported (torch, transformers, every test module) lives as long as this process: moved
    out of the garbage collector's sweeps, which the in-process runs' objects would otherwise make it walk
    again and again (what launcher/collector.py does for python -m launcher)."""
    import gc

    gc.freeze()


def _group(config, item, name: str) -> None:
    """Mark the item with xdist_group(name), and give its id the `@name` that loadgroup schedules by.
    pytest-xdist 3.8 writes that suffix into `item._nodeid`, which pytest 9.2 no longer reads (the id is
    `item._id`): the mark alone changed nothing, and every group was spread over both workers
    (pytest-dev/pytest-xdist#1386). Written here into the id that pytest reads, on a loadgroup worker only."""
    item.add_marker(pytest.mark.xdist_group(name))
    if getattr(config.option, "loadgroup", False) and hasattr(item, "_id") and not hasattr(item, "_nodeid"):
        from _pytest.nodeid import NodeId

        item._id = NodeId.parse(f"{item.nodeid}@{name}")


def _uses_a_module_fixture(item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    return any(defs and defs[-1].scope == "module" for defs in (info.name2fixturedefs.values() if info else ()))
