"""checkpoint.async_save for the full format (single, ddp), and what a failing save does: a save in the
background or to an object store that fails leaves the newest sealed checkpoint as it was, is said, and the
next save tries again; three failing in a row stop the run with exit code 7. The object store is a real S3
API server on loopback (moto's) behind tests/flaky_store.py, which fails the requests a test chooses."""

import os

import pytest
import torch

from launcher.checkpoint import manifest
from launcher.checkpoint.s3_connector import installed as carried  # s3torchconnector moves s3://'s objects
from launcher.checkpoint.staging import Staging
from launcher.cli import main
from tests.conftest import QUICKSTART, SMALL, assert_same_weights, train

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")
from tests.s3 import BUCKET, s3  # noqa: E402,F401 - the S3 server, shared

# no memory planner beside each run (a process of its own): no test here reads the `memory:` line
NO_PLAN = "logging.memory_plan=false"


@pytest.mark.slow  # a longer run: left out of the fast tier (-m "not slow")
def test_a_background_save_writes_what_a_synchronous_one_does_and_resumes_exactly(tmp_path, capsys):
    common = ["trainer.max_steps=40", "checkpoint.every=10", "checkpoint.keep=4", "logging.jsonl=true", NO_PLAN]
    train(tmp_path / "sync", *common)
    train(tmp_path / "async", *common, "checkpoint.async_save=true")
    for step in (10, 20, 30, 40):
        sync, background = (tmp_path / run / "checkpoints" / f"step_{step}" for run in ("sync", "async"))
        assert manifest.verify(background) is None
        assert (background / "model.pt").read_bytes() == (sync / "model.pt").read_bytes()
        a, b = (torch.load(folder / "state.pt", weights_only=True) for folder in (sync, background))
        assert a.pop("recipe") != b.pop("recipe")  # the run folder and async_save: all else is equal
        assert equal(a, b)
    # a run that continues from the background save of step 20 ends with the same weights
    train(tmp_path / "again", *common, f"checkpoint.resume={tmp_path / 'async' / 'checkpoints' / 'step_20'}")
    assert_same_weights(tmp_path / "sync" / "model.pt", tmp_path / "again" / "model.pt")
    logged = (tmp_path / "async" / "metrics.jsonl").read_text()
    assert logged.count('"checkpoint/blocked_s"') == 4  # each save's cost to the step, logged at its step


def equal(a, b) -> bool:
    """The same nested values, tensors bitwise."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    return a == b


def test_staging_copies_once_keeps_ties_and_reuses_its_buffers():
    weight = torch.randn(4, 3)
    state = {"a": weight, "tied": weight, "rows": [torch.arange(3), {"n": 1, "s": "x"}], "pair": (torch.ones(2), 2.0)}
    staging = Staging()
    copied = staging.copy(state)
    assert copied["tied"] is copied["a"] and copied["a"] is not weight and torch.equal(copied["a"], weight)
    assert copied["rows"][1] == {"n": 1, "s": "x"} and copied["pair"][1] == 2.0 and isinstance(copied["pair"], tuple)
    weight.add_(1)  # training goes on: the staged copy keeps the saved values
    assert not torch.equal(copied["a"], weight)
    again = staging.copy(state)
    assert again["a"].data_ptr() == copied["a"].data_ptr() and torch.equal(again["a"], weight)  # the same buffer


@pytest.fixture
def flaky(s3, monkeypatch):
    """The S3 server behind a store that fails chosen requests; one try a request, as a store gone stays gone."""
    from tests.flaky_store import FlakyStore

    store = FlakyStore(os.environ["AWS_ENDPOINT_URL"])
    monkeypatch.setenv("AWS_ENDPOINT_URL", store.url)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    yield store
    store.close()


@pytest.mark.slow  # a longer run: left out of the fast tier (-m "not slow")
def test_a_failed_background_upload_is_said_and_the_next_save_tries_again(s3, flaky, tmp_path, capsys, one_rank):
    """fsdp (a torchrun world of one: DCP's shards, written by its async_save). Step 10's upload slow (each
    request held a second): step 20's save waits for it, and says so once. The uploads of steps 20 and 30
    refused (403, as a policy denying writes): the run says so each time, trains on, and the save of step 40
    seals; the refused steps leave no object behind, and the weights are an uninterrupted run's."""
    flaky.rules = {r"/step_10/": "slow", r"/step_(20|30)/": "refuse"}
    url, fsdp = f"s3://{BUCKET}/retried", ["strategy=fsdp", "devices=cpu", NO_PLAN]
    code = main([str(QUICKSTART), *SMALL, *fsdp, f"run_dir={tmp_path / 'run'}", "trainer.max_steps=40",
                 "checkpoint.every=10", f"checkpoint.dir={url}", "checkpoint.async_save=true"])
    out = capsys.readouterr().out
    assert code == 0 and flaky.failed, out
    for step, failed in ((20, 1), (30, 2)):
        assert (f"checkpoint step {step} was not saved (cannot write {url}: Access Denied" in out
                and f"the newest sealed checkpoint: {url}/step_10 (step 10). Training goes on and the next save tries "
                    f"again ({failed} of 3 failed in a row stop the run)" in out), out
    assert f"checkpoint step 40 saved: {url}/step_40" in out
    assert out.count("is still being written") == 1 and "checkpoint step 10 is still being written (" in out, out
    assert not [key for key in s3.objects("retried") if key.startswith(("step_20", "step_30"))]
    train(tmp_path / "whole", *fsdp, "trainer.max_steps=40")
    assert_same_weights(tmp_path / "whole" / "model.pt", tmp_path / "run" / "model.pt")


@pytest.mark.slow  # a longer run: left out of the fast tier (-m "not slow")
def test_a_store_gone_for_three_saves_stops_the_run_with_exit_7_and_the_sealed_one_resumes(s3, flaky, tmp_path, capsys):
    """From step 20 on, every write's connection closed without an answer (the store gone mid-upload): the
    saves of steps 20 and 30 fail, the final one of step 40 fails and tries again at once, and the run stops
    (exit 7) naming step 10, sealed and intact; with the store back the same command resumes from it."""
    flaky.rules = {r"/step_(20|30|40)/": "drop"}
    url = f"s3://{BUCKET}/gone"
    args = [str(QUICKSTART), *SMALL, f"run_dir={tmp_path / 'run'}", "trainer.max_steps=40", "checkpoint.every=10",
            f"checkpoint.dir={url}", NO_PLAN]
    assert main(args) == 7
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    closed = "S3Exception: socket is closed (AWS_IO_SOCKET_CLOSED)" if carried() else "ConnectionClosedError: "
    assert (f"checkpoint: 3 saves in a row failed, the last at step 40 (cannot write {url}: {closed}"
            in err and f"the run stops. The newest sealed checkpoint: {url}/step_10 (step 10); the same command "
                       f"resumes from it" in err), err
    assert out.count("was not saved") == 2 and not (tmp_path / "run" / "model.pt").exists()
    flaky.rules = {}
    assert main(args) == 0
    assert f"resumed from {url}/step_10 (step 10" in capsys.readouterr().out
    train(tmp_path / "whole", "trainer.max_steps=40", NO_PLAN)
    assert_same_weights(tmp_path / "whole" / "model.pt", tmp_path / "run" / "model.pt")


@pytest.mark.slow  # four processes, about 25 s
def test_the_benchmarks_checkpoint_row(monkeypatch, capsys):
    """`python -m launcher.bench --saves` at its smallest: one save a run besides the final one, and the S3 clients
    row (the figures are docs/performance.md's, from the default sizes; here only that every side ran and said
    what it measured). The benchmark's own process is this one (torch imported once): each run and each client's
    figures are still a process of their own, as the benchmark starts them."""
    import re

    from launcher.bench.__main__ import main as bench

    monkeypatch.setattr("sys.argv", ["python -m launcher.bench", "--saves", "--reps", "1", "--saves-width", "256",
                                     "--saves-every", "10", "--saves-count", "1"])
    capsys.readouterr()
    code = bench()
    out, err = capsys.readouterr()
    assert code == 0, err[-2000:]
    for store in ("local disk", r"S3 \(moto, loopback\)"):
        row = re.search(rf"^{store} +(\d+)ms +(\d+)ms +(\d\.\d{{3}})$", out, re.M)
        assert row and int(row.group(1)) > 0, out
    if carried():  # the S3 clients row: each format through each client, and their ratios
        for fmt in ("sharded", "full"):
            for client in ("s3fs", "s3torchconnector"):
                assert re.search(rf"^{fmt} / {client} +(\d+\.\d\ds *){{4}} *\d+ MiB$", out, re.M), out
            assert re.search(rf"^{fmt} / s3fs over s3tc +(\d+\.\d\dx *){{5}}$", out, re.M), out


KILLED = {"between": r"/step_10/manifest\.json", "inside": r"/step_20/model\.pt"}  # the store dies after it


@pytest.mark.parametrize("background, killed", [(False, "between"), (True, "between"), (False, "inside")],
                         ids=["sync", "async", "sync-inside-an-upload"])
def test_a_store_killed_mid_run_fails_each_save_in_one_line_and_stops_with_exit_7(s3, flaky, tmp_path, capsys,
                                                                                   monkeypatch, background, killed):
    """The store's process killed once step 10 is sealed, or inside step 20's upload of model.pt (every connection
    refused or closed from then on): each save after it fails with one line (between saves, the first one meets
    the dead store deleting what a re-save of its step would replace), training goes on, and the final save makes
    three: exit 7 naming step 10, no traceback. With the store back the same command resumes from step 10 bitwise."""
    flaky.rules = {KILLED[killed]: "die"}
    url = f"s3://{BUCKET}/killed-{'async' if background else 'sync'}-{killed}"
    args = [str(QUICKSTART), *SMALL, f"run_dir={tmp_path / 'run'}", "trainer.max_steps=40", "checkpoint.every=10",
            f"checkpoint.dir={url}", NO_PLAN, f"checkpoint.async_save={str(background).lower()}"]
    assert main(args) == 7
    out, err = capsys.readouterr()
    assert flaky.dead and "Traceback" not in out + err, out + err
    assert out.count("was not saved (cannot write") == 2 and err.strip().count("\n") == 0, out + err
    # the store dead, what it holds cannot be read: the line names the newest the run knew of, and says so
    assert (f"checkpoint: 3 saves in a row failed, the last at step 40 (cannot write {url}: " in err
            and f"The newest sealed checkpoint: {url}/step_10 (step 10) as this run last knew it (the store cannot be "
                f"read now to tell whether step 40's manifest landed before the failure); the same command resumes from "
                f"the newest sealed one" in err), err
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.env["AWS_ENDPOINT_URL"])  # the store back
    assert main(args) == 0
    assert f"resumed from {url}/step_10 (step 10" in capsys.readouterr().out
    train(tmp_path / "whole", "trainer.max_steps=40", NO_PLAN)
    assert_same_weights(tmp_path / "whole" / "model.pt", tmp_path / "run" / "model.pt")


@pytest.mark.slow  # two torchrun launches of fsdp x 2
def test_a_store_killed_under_fsdp_x2_stops_every_rank_with_exit_7_and_the_rerun_resumes(s3, flaky, tmp_path, monkeypatch):
    """fsdp x 2 (torchrun, gloo), background saves of DCP's shards: the store killed once step 10 is sealed fails
    the saves of steps 20, 30 and 40 on both ranks, each said once by rank 0, and every rank stops with the one
    line of exit 7, no traceback; with the store back the same command resumes from step 10 on both ranks."""
    from tests.several_runs import several
    from tests.test_fsdp import FSDP, QUICK

    flaky.rules = {r"/step_10/manifest\.json": "die"}
    url = f"s3://{BUCKET}/killed-fsdp"
    case = [*QUICK, *FSDP, NO_PLAN, "trainer.max_steps=40", "checkpoint.every=10", "checkpoint.async_save=true",
            f"checkpoint.dir={url}", f"run_dir={tmp_path / 'run'}"]
    ranks = several({"killed": case}, tmp_path)
    assert flaky.dead
    stopped = f"CheckpointsFailed: checkpoint: 3 saves in a row failed, the last at step 40 (cannot write {url}: "
    assert all(rank["killed"]["error"].startswith(stopped) for rank in ranks), ranks
    assert f"The newest sealed checkpoint: {url}/step_10 (step 10)" in ranks[0]["killed"]["error"]
    assert ranks[0]["killed"]["said"].count("was not saved (cannot write") == 2, ranks[0]["killed"]["said"]
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.env["AWS_ENDPOINT_URL"])  # the store back
    ranks = several({"again": case}, tmp_path)
    assert [rank["again"]["error"] for rank in ranks] == [None, None], ranks
    assert f"resumed from {url}/step_10 (step 10" in ranks[0]["again"]["said"]


@pytest.mark.slow  # two runs against the store, about 10 CPU s
def test_a_save_whose_manifest_landed_before_a_failure_is_sealed_and_the_lines_say_what_the_store_holds(
        s3, flaky, tmp_path, capsys):
    """Step 20's manifest is stored but its answer is lost (the connection closed): the store holds step 20 sealed,
    so the run says it is saved. Steps 30 and 40 dropped: the lines name step 20 as the newest sealed, and the same
    command resumes from it (before: "step 20 was not saved", and the newest named step 10)."""
    flaky.rules = {r"/step_20/manifest\.json": "lost", r"/step_(30|40)/": "drop"}
    url = f"s3://{BUCKET}/landed"
    args = [str(QUICKSTART), *SMALL, f"run_dir={tmp_path / 'run'}", "trainer.max_steps=40", "checkpoint.every=10",
            f"checkpoint.dir={url}", NO_PLAN]
    assert main(args) == 7
    out, err = capsys.readouterr()
    assert any("/step_20/manifest.json" in failed for failed in flaky.failed), flaky.failed
    assert f"checkpoint step 20 saved: {url}/step_20 (its manifest is in; a request after it failed: cannot write " in out
    assert "step 20 was not saved" not in out and out.count("was not saved") == 2, out  # steps 30 and 40
    assert f"checkpoint step 30 was not saved (cannot write {url}: " in out
    assert f"the newest sealed checkpoint: {url}/step_20 (step 20). Training goes on" in out, out
    assert f"The newest sealed checkpoint: {url}/step_20 (step 20); the same command resumes from it" in err, err
    flaky.rules = {}
    assert main(args) == 0
    assert f"resumed from {url}/step_20 (step 20" in capsys.readouterr().out


@pytest.mark.slow  # a run against a store that dies, about 7 CPU s
def test_a_store_out_of_reach_after_a_failed_save_is_said_to_be_unknown(s3, flaky, tmp_path, capsys):
    """Step 20's manifest stored, its answer lost, and the store gone: the store cannot be read to tell whether step
    20 is sealed, and the line says so rather than naming step 10 as the newest for sure."""
    flaky.rules = {r"/step_20/manifest\.json": "lost+die"}
    url = f"s3://{BUCKET}/landed-unknown"
    args = [str(QUICKSTART), *SMALL, f"run_dir={tmp_path / 'run'}", "trainer.max_steps=20", "checkpoint.every=10",
            f"checkpoint.dir={url}", NO_PLAN, "checkpoint.keep=5"]
    assert main(args) == 7
    out, err = capsys.readouterr()
    assert flaky.dead
    assert (f"the newest sealed checkpoint: {url}/step_10 (step 10) as this run last knew it (the store cannot be read "
            f"now to tell whether step 20's manifest landed before the failure)") in out, out
    assert "step_20/manifest.json" in s3.objects("landed-unknown")  # sealed in the store, as the line allows
