"""Checkpoints: DESIGN's run folder, unwrapped keys, atomic writes, retention, tolerant and safe loading."""

import json
import pickle
import shutil
import subprocess
import sys
import zlib

import pytest
import torch
from torch import nn

from launcher.checkpoint import Checkpoints, RunState, choose, complete, load_model_state
from launcher.checkpoint import full
from launcher.cli import main
from launcher.data.sampling import Position
from launcher.errors import UserError
from launcher.model.precision import Precision
from launcher.recipe.schema import CheckpointConfig
from launcher.placement.scheduler import Placement
from launcher.strategies import Strategy
from recipes.components.mlp import MLP
from tests.conftest import SMALL, assert_same_weights, launch, state_dict, train
from tests.test_loop import stop_after


def test_run_folder_matches_design(tmp_path):
    train(tmp_path, "checkpoint.every=20", "checkpoint.keep=2")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "checkpoints", "model.pt", "recipe.yaml"]
    folders = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert folders == ["latest", "step_60", "step_80"]  # the newest two kept
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_80"
    step = tmp_path / "checkpoints" / "step_80"
    assert sorted(p.name for p in step.iterdir()) == ["manifest.json", "model.pt", "state.pt"]
    manifest = json.loads((step / "manifest.json").read_text())
    assert manifest["step"] == 80 and manifest["files"]["model.pt"]["size"] == (step / "model.pt").stat().st_size
    assert manifest["files"]["state.pt"]["crc32"] == f"{zlib.crc32((step / 'state.pt').read_bytes()):08x}"
    state = torch.load(step / "state.pt", weights_only=True)
    assert {"optimizer", "lr_schedule", "scaler", "position", "rng", "recipe"} <= state.keys()
    assert "name: quickstart" in state["recipe"] and "name: quickstart" in (tmp_path / "recipe.yaml").read_text()


def test_model_file_is_the_plain_state_dict(tmp_path):
    train(tmp_path)
    for path in (tmp_path / "model.pt", tmp_path / "checkpoints" / "step_80" / "model.pt"):
        saved = state_dict(path)
        assert not any(k.startswith(("module.", "_orig_mod.")) or ".module." in k for k in saved)
        assert all(t.device.type == "cpu" for t in saved.values())
        MLP(in_dim=32, hidden=128, classes=10).load_state_dict(saved, strict=True)


class Keeper:
    """Rank 0's writes of full checkpoints into <run_dir>/checkpoints, as a run makes them."""

    def __init__(self, run_dir, keep):
        self.folder, self.keep = run_dir / "checkpoints", keep

    def save(self, step, model_state, state):
        return full.write(self.folder, step, model_state, state, self.keep)

    def complete(self):
        return complete(self.folder)


def test_resume_takes_the_newest_complete_checkpoint(tmp_path):
    keeper = Keeper(tmp_path, keep=5)
    model = MLP()
    keeper.save(10, model.state_dict(), {"x": 1})
    keeper.save(20, model.state_dict(), {"x": 2})
    (tmp_path / "checkpoints" / "step_20" / "manifest.json").unlink()  # as if killed before the manifest
    (tmp_path / "checkpoints" / "step_30").mkdir()  # an empty folder
    assert choose(keeper.folder, "auto") == (tmp_path / "checkpoints" / "step_10", [])
    assert choose(keeper.folder, "never") == (None, [])
    with pytest.raises(UserError, match="is incomplete"):
        choose(keeper.folder, str(tmp_path / "checkpoints" / "step_20"))


def test_a_truncated_file_makes_its_checkpoint_incomplete(tmp_path):
    keeper = Keeper(tmp_path, keep=5)
    keeper.save(10, MLP().state_dict(), {})
    keeper.save(20, MLP().state_dict(), {})
    model_file = tmp_path / "checkpoints" / "step_20" / "model.pt"
    model_file.write_bytes(model_file.read_bytes()[:100])
    assert choose(keeper.folder, "auto")[0].name == "step_10"


def test_retention_never_deletes_the_newest_complete(tmp_path):
    keeper = Keeper(tmp_path, keep=1)
    for step in (1, 2, 3):
        keeper.save(step, MLP().state_dict(), {})
    assert [p.name for p in keeper.complete()] == ["step_3"]


def test_non_writers_write_nothing(tmp_path):
    strategy = Strategy(Placement(rank=1, world_size=2))  # not rank 0: its collectives are this process's alone
    model = MLP()
    run = RunState(Position(), None, Precision("fp32", torch.device("cpu")), strategy, "name: x\n")
    checkpoints = Checkpoints(strategy, model, torch.optim.SGD(model.parameters(), lr=0.1), run, tmp_path,
                              CheckpointConfig(keep=1))
    checkpoints.save(final=True)
    assert checkpoints.saved_step == 0 and not any(tmp_path.iterdir())


class Compiled(nn.Module):
    """The layout of torch.compile's OptimizedModule (the model under `_orig_mod`), without starting
    inductor's compile workers, which would slow every later test on a small machine."""

    def __init__(self, model):
        super().__init__()
        self._orig_mod = model


@pytest.mark.parametrize("wrap", [
    lambda m: nn.DataParallel(m),
    lambda m: Compiled(m),
    lambda m: nn.DataParallel(Compiled(m)),
], ids=["module.", "_orig_mod.", "module._orig_mod."])
def test_init_from_accepts_wrapper_prefixes(tmp_path, wrap):
    source = MLP()
    wrapped = wrap(source)
    torch.save(wrapped.state_dict(), tmp_path / "wrapped.pt")
    assert next(iter(wrapped.state_dict())).startswith(("module.", "_orig_mod."))
    target = MLP()
    load_model_state(target, tmp_path / "wrapped.pt")
    for a, b in zip(source.state_dict().values(), target.state_dict().values()):
        assert torch.equal(a, b)


def test_init_from_in_a_recipe(tmp_path):
    source = MLP()
    torch.save(nn.DataParallel(source).state_dict(), tmp_path / "dp.pt")
    train(tmp_path / "run", f"checkpoint.init_from={tmp_path / 'dp.pt'}", "trainer.max_steps=1",
          "optimizer.lr=0.0")
    final = state_dict(tmp_path / "run" / "model.pt")
    assert all(torch.equal(final[k], v) for k, v in source.state_dict().items())


def test_another_models_checkpoint_names_the_first_difference(tmp_path):
    torch.save(MLP(hidden=64).state_dict(), tmp_path / "other.pt")
    with pytest.raises(UserError, match=r"'0.weight' is \(64, 32\) in the file, \(128, 32\) in the model"):
        load_model_state(MLP(), tmp_path / "other.pt")
    torch.save(MLP(layers=1).state_dict(), tmp_path / "fewer.pt")
    with pytest.raises(UserError, match=r"'2.weight' is \(10, 128\) in the file, \(128, 128\) in the model"):
        load_model_state(MLP(), tmp_path / "fewer.pt")
    partial = MLP().state_dict()
    del partial["4.bias"]
    torch.save(partial, tmp_path / "partial.pt")
    with pytest.raises(UserError, match="'4.bias' is missing from the file"):
        load_model_state(MLP(), tmp_path / "partial.pt")
    torch.save({**MLP().state_dict(), "extra.weight": torch.zeros(1)}, tmp_path / "extra.pt")
    with pytest.raises(UserError, match="the file has 'extra.weight', which the model lacks"):
        load_model_state(MLP(), tmp_path / "extra.pt")
    done = launch("recipes/quickstart.yaml", f"checkpoint.init_from={tmp_path / 'other.pt'}", f"run_dir={tmp_path / 'r'}")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().endswith("does not fit this model: '0.weight' is (64, 32) in the file, (128, 32) in the model")


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_file_that_would_run_code_is_refused(tmp_path):
    marker = tmp_path / "ran"
    with open(tmp_path / "evil.pt", "wb") as f:
        pickle.dump({"0.weight": _RunsCode(str(marker))}, f)
    torch.save({"0.weight": _RunsCode(str(marker))}, tmp_path / "evil2.pt")
    marker.unlink(missing_ok=True)  # torch.save pickles without calling it; make sure
    for name in ("evil.pt", "evil2.pt"):
        with pytest.raises(UserError, match="weights_only=True"):
            load_model_state(MLP(), tmp_path / name)
    assert not marker.exists()


# --- One history per run folder (resume=never, an earlier checkpoint) -------------------------------

def test_starting_over_moves_the_earlier_run_aside_and_keeps_every_new_checkpoint(tmp_path, capsys):
    train(tmp_path, "trainer.max_steps=20", "checkpoint.every=4", "checkpoint.keep=2")
    old = state_dict(tmp_path / "model.pt")
    capsys.readouterr()
    train(tmp_path, "trainer.max_steps=12", "checkpoint.every=4", "checkpoint.keep=2", "checkpoint.resume=never",
          "seed=1")
    out = capsys.readouterr().out
    assert f"the run starts over: moved what an earlier run left in {tmp_path} (checkpoints, model.pt, recipe.yaml) to" in out
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_12", "step_8"]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_12"
    replaced = list((tmp_path / "replaced").iterdir())
    assert len(replaced) == 1 and sorted(p.name for p in (replaced[0] / "checkpoints").glob("step_*")) == ["step_16", "step_20"]
    assert all(torch.equal(v, state_dict(replaced[0] / "model.pt")[k]) for k, v in old.items())
    new = state_dict(tmp_path / "model.pt")
    # resume=auto now continues the new run (finished at 12), not the old one (at 20)
    train(tmp_path, "trainer.max_steps=12", "checkpoint.every=4", "checkpoint.keep=2", "seed=1")
    assert "already finished at step 12" in capsys.readouterr().out
    assert all(torch.equal(v, state_dict(tmp_path / "model.pt")[k]) for k, v in new.items())


def test_resuming_another_folders_checkpoint_sets_this_ones_history_aside(tmp_path):
    train(tmp_path / "whole", "trainer.max_steps=40")
    train(tmp_path / "early", "trainer.max_steps=40", "checkpoint.every=10", "checkpoint.keep=4")
    run = tmp_path / "run"
    train(run, "trainer.max_steps=40", "seed=1", "checkpoint.every=10", "checkpoint.keep=1")  # another history
    train(run, "trainer.max_steps=40", "checkpoint.every=10", "checkpoint.keep=1",
          f"checkpoint.resume={tmp_path / 'early' / 'checkpoints' / 'step_10'}")
    assert [p.name for p in complete(run / "checkpoints")] == ["step_40"]
    (aside,) = (run / "replaced").iterdir()
    assert [p.name for p in complete(aside / "checkpoints")] == ["step_40"] and (aside / "model.pt").exists()
    assert_same_weights(tmp_path / "whole" / "model.pt", run / "model.pt")


def test_an_explicit_earlier_checkpoint_of_the_same_folder(tmp_path):
    train(tmp_path, "trainer.max_steps=40", "checkpoint.every=10", "checkpoint.keep=4")
    reference = state_dict(tmp_path / "model.pt")
    train(tmp_path, "trainer.max_steps=40", "checkpoint.every=10", "checkpoint.keep=2",
          f"checkpoint.resume={tmp_path / 'checkpoints' / 'step_20'}")
    assert [p.name for p in complete(tmp_path / "checkpoints")] == ["step_30", "step_40"]
    (aside,) = (tmp_path / "replaced").iterdir()
    assert sorted(p.name for p in (aside / "checkpoints").iterdir()) == ["step_30", "step_40"]
    assert (aside / "model.pt").exists()
    assert all(torch.equal(v, state_dict(tmp_path / "model.pt")[k]) for k, v in reference.items())


def test_retention_never_deletes_the_checkpoint_it_just_wrote(tmp_path):
    keeper = Keeper(tmp_path, keep=1)
    keeper.save(20, MLP().state_dict(), {})
    keeper.save(8, MLP().state_dict(), {})  # a folder that holds a higher step (made by hand)
    assert (tmp_path / "checkpoints" / "step_8").is_dir()
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_8"


def test_a_second_run_on_the_same_folder_is_refused(tmp_path, capsys):
    train(tmp_path, "trainer.max_steps=1")
    holder = subprocess.Popen([sys.executable, "-c", (  # another process, as a second run would be
        "import fcntl, os, sys\n"
        f"fd = os.open({str(tmp_path / '.lock')!r}, os.O_RDWR)\n"
        "fcntl.lockf(fd, fcntl.LOCK_EX)\n"
        "print('held', flush=True); sys.stdin.read()\n")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        code = main(["recipes/quickstart.yaml", *SMALL, f"run_dir={tmp_path}"])
    finally:
        holder.communicate("")
    err = capsys.readouterr().err.splitlines()
    assert code == 2 and len(err) == 1 and f"run_dir: {tmp_path} is in use by another run (pid " in err[0], err
    assert train(tmp_path, "trainer.max_steps=1") == {}  # released: the next run goes on


def test_the_lock_is_not_held_by_dataloader_workers(tmp_path):
    """Persistent workers are forked from the run: the lock must not outlive the run in them."""
    train(tmp_path, "data.num_workers=2", "trainer.max_steps=2")
    train(tmp_path, "data.num_workers=2", "trainer.max_steps=4")


# --- Integrity: CRC-32 per file, a damaged checkpoint is passed over ------------------------------

def flip_a_bit(path, where: float = 0.6) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * where)] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("name", ["model.pt", "state.pt"])
def test_a_flipped_bit_falls_back_to_the_checkpoint_before(tmp_path, capsys, name):
    train(tmp_path / "whole", "trainer.max_steps=60")
    run = tmp_path / "run"
    train(run, "trainer.max_steps=60", "checkpoint.every=20", "checkpoint.keep=3")
    stop_after(run, 40)
    flip_a_bit(run / "checkpoints" / "step_40" / name)
    capsys.readouterr()
    train(run, "trainer.max_steps=60")
    out = capsys.readouterr().out
    damaged = [line for line in out.splitlines() if "damaged" in line]
    assert len(damaged) == 1 and f"step_40 is damaged ({name}: CRC-32" in damaged[0], out
    assert f"resumed from {run / 'checkpoints' / 'step_20'}" in out
    assert_same_weights(tmp_path / "whole" / "model.pt", run / "model.pt")


def test_a_damaged_checkpoint_named_explicitly_or_as_init_from_is_refused(tmp_path):
    keeper = Keeper(tmp_path, keep=2)
    keeper.save(10, MLP().state_dict(), {})
    flip_a_bit(tmp_path / "checkpoints" / "step_10" / "model.pt")
    with pytest.raises(UserError, match=r"step_10 is damaged \(model.pt: CRC-32 [0-9a-f]{8}, the manifest says"):
        choose(keeper.folder, str(tmp_path / "checkpoints" / "step_10"))
    with pytest.raises(UserError, match="damaged: its CRC-32 differs from the one"):
        load_model_state(MLP(), tmp_path / "checkpoints" / "step_10" / "model.pt")


def test_checkpoints_of_the_first_format_still_resume(tmp_path, capsys):
    """Manifests before checksums listed sizes alone: they are complete, and resume on sizes."""
    train(tmp_path, "trainer.max_steps=20", "checkpoint.every=10")
    for step in ("step_10", "step_20"):
        path = tmp_path / "checkpoints" / step / "manifest.json"
        manifest = json.loads(path.read_text())
        manifest["files"] = {k: v["size"] for k, v in manifest["files"].items()}
        del manifest["format"]
        path.write_text(json.dumps(manifest))
    (tmp_path / "model.pt").unlink()
    shutil.rmtree(tmp_path / "checkpoints" / "step_20")
    capsys.readouterr()
    train(tmp_path, "trainer.max_steps=20")
    assert f"resumed from {tmp_path / 'checkpoints' / 'step_10'}" in capsys.readouterr().out


# --- A checkpoint is data --------------------------------------------------------------------------

def rewrite_state(folder, change) -> None:
    """Change a checkpoint's state.pt and record the new size and CRC-32, as a crafted file would."""
    state = torch.load(folder / "state.pt", weights_only=True)
    state = change(state)
    torch.save(state, folder / "state.pt")
    manifest = json.loads((folder / "manifest.json").read_text())
    data = (folder / "state.pt").read_bytes()
    manifest["files"]["state.pt"] = {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    (folder / "manifest.json").write_text(json.dumps(manifest))


def test_a_saved_recipe_is_never_resolved(tmp_path, capsys, monkeypatch):
    train(tmp_path, "trainer.max_steps=20", "checkpoint.every=10")
    stop_after(tmp_path, 10)
    secret = "hunter2-must-not-print"
    monkeypatch.setenv("LAUNCHER_TEST_SECRET", secret)

    def craft(state):
        state["recipe"] = state["recipe"].replace("seed: 0", "seed: ${oc.env:LAUNCHER_TEST_SECRET}")
        return state

    rewrite_state(tmp_path / "checkpoints" / "step_10", craft)
    capsys.readouterr()
    train(tmp_path, "trainer.max_steps=20")
    out = capsys.readouterr()
    assert secret not in out.out + out.err
    assert "seed (${oc.env:LAUNCHER_TEST_SECRET} -> 0)" in out.out


def test_a_checkpoints_own_text_is_shown_escaped(tmp_path, capsys):
    """A manifest's file names and a saved recipe's values are a checkpoint's text, which anyone may have written:
    the lines that quote them (a damaged checkpoint passed over, the recipe's differences) show them escaped, so
    that they add no line to the console and send nothing to the terminal."""
    train(tmp_path, "trainer.max_steps=20", "checkpoint.every=10")
    stop_after(tmp_path, 20)
    forged = "x\nlauncher: done\x1b]0;pwned\x07"
    path = tmp_path / "checkpoints" / "step_20" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["files"][forged] = {"size": 1}
    path.write_text(json.dumps(manifest))

    def craft(state):
        state["recipe"] = state["recipe"].replace("seed: 0", 'seed: "0\\e[31m\\u202e"')
        return state

    rewrite_state(tmp_path / "checkpoints" / "step_10", craft)
    capsys.readouterr()
    train(tmp_path, "trainer.max_steps=20")
    out, err = capsys.readouterr()
    assert "\x1b" not in out + err and "\u202e" not in out + err, out + err
    damaged = [line for line in out.splitlines() if "damaged" in line]
    assert len(damaged) == 1 and "step_20 is damaged (x\\nlauncher: done\\x1b]0;pwned\\x07: " in damaged[0], out
    assert not any(line.startswith("launcher: done") for line in out.splitlines())
    assert "seed (0\\x1b[31m\\u202e -> 0)" in out, out


def _drop(key):
    return lambda s: {k: v for k, v in s.items() if k != key}


@pytest.mark.parametrize("change, says", [
    (_drop("optimizer"), "missing optimizer"),
    (lambda s: {**s, "payload": 1}, "unknown field 'payload'"),
    (lambda s: {**s, "position": [1, 2]}, "position is a list"),
    (lambda s: {**s, "position": {"step": 1}}, "position must hold step, epoch, batch"),
    (lambda s: {**s, "position": {"step": -1, "epoch": 0, "batch": 0}}, "position must hold step, epoch, batch"),
    (lambda s: {**s, "optimizer": {"state": []}}, "optimizer is not an optimizer's state_dict"),
    (lambda s: {**s, "rng": []}, "rng must list each rank's generator states"),
    (lambda s: {**s, "recipe": 3}, "recipe is a int"),
    (lambda s: {**s, "recipe": "a: &x [1]\nb: *x\n"}, "aliases"),
    (lambda s: {**s, "optimizer": {"state": {}, "param_groups": [{"lr": 1.0}]}}, "does not fit this run"),
    (lambda s: {**s, "rng": [{"torch": torch.zeros(3, dtype=torch.uint8), "python": [3]}]}, "does not fit this run"),
    (lambda s: [1, 2], "a list, not a mapping"),
], ids=["missing", "extra", "wrong-type", "position-keys", "position-negative", "optimizer-shape", "rng-empty",
        "recipe-type", "recipe-aliases", "optimizer-groups", "rng-values", "not-a-mapping"])
def test_a_state_of_the_wrong_structure_is_one_line(tmp_path, capsys, change, says):
    train(tmp_path, "trainer.max_steps=20", "checkpoint.every=10")
    stop_after(tmp_path, 10)
    rewrite_state(tmp_path / "checkpoints" / "step_10", change)
    capsys.readouterr()
    code = main(["recipes/quickstart.yaml", *SMALL, "trainer.max_steps=20", f"run_dir={tmp_path}"])
    err = capsys.readouterr().err.splitlines()
    assert code == 2 and len(err) == 1 and says in err[0], err


@pytest.mark.parametrize("override, says", [
    ("optimizer={_target_: torch.optim.SGD, lr: 0.1}", "changed optimizer (torch.optim.AdamW -> torch.optim.SGD)"),
    ("lr_schedule={_target_: torch.optim.lr_scheduler.StepLR, step_size: 5}",
     "changed lr_schedule (none -> torch.optim.lr_scheduler.StepLR)"),
], ids=["optimizer-class", "schedule-added"])
def test_resuming_under_another_optimizer_or_schedule_is_refused(tmp_path, capsys, override, says):
    train(tmp_path, "trainer.max_steps=20", "checkpoint.every=10")
    stop_after(tmp_path, 10)
    capsys.readouterr()
    code = main(["recipes/quickstart.yaml", *SMALL, "trainer.max_steps=20", f"run_dir={tmp_path}", override])
    err = capsys.readouterr().err.splitlines()
    assert code == 2 and len(err) == 1 and says in err[0] and "checkpoint.resume=never" in err[0], err
    # the hint works as written, though starting over moves that checkpoint aside first
    weights = state_dict(tmp_path / "checkpoints" / "step_10" / "model.pt")
    hint = err[0].split("(add ")[1].split(" to keep")[0]
    assert main(["recipes/quickstart.yaml", *SMALL, "trainer.max_steps=1", f"run_dir={tmp_path}", override,
                 "checkpoint.resume=never", hint, "optimizer.lr=0.0"]) == 0
    assert all(torch.equal(v, state_dict(tmp_path / "model.pt")[k]) for k, v in weights.items())


# --- init_from: weights nested by other tools ------------------------------------------------------

@pytest.mark.parametrize("wrap, says", [
    (lambda sd: {"state_dict": sd, "epoch": 3}, "the weights under 'state_dict'"),
    (lambda sd: {"model": sd, "optimizer": {"state": {}}}, "the weights under 'model'"),
    (lambda sd: {"epoch": 3, "global_step": 30, "pytorch-lightning_version": "2.4.0",
                 "state_dict": {f"model.{k}": v for k, v in sd.items()}, "optimizer_states": [{}]},
     "the weights under 'state_dict', prefix 'model.' removed"),
], ids=["state_dict", "model", "lightning"])
def test_init_from_finds_nested_weights_and_says_where(tmp_path, capsys, wrap, says):
    source = MLP()
    torch.save(wrap(source.state_dict()), tmp_path / "nested.ckpt")
    train(tmp_path / "run", f"checkpoint.init_from={tmp_path / 'nested.ckpt'}", "trainer.max_steps=1", "optimizer.lr=0.0")
    assert f"initialised the model from {tmp_path / 'nested.ckpt'} ({says})" in capsys.readouterr().out
    final = state_dict(tmp_path / "run" / "model.pt")
    assert all(torch.equal(final[k], v) for k, v in source.state_dict().items())


def test_nested_weights_that_do_not_fit_name_the_nesting(tmp_path):
    torch.save({"state_dict": MLP(hidden=64).state_dict(), "epoch": 1}, tmp_path / "other.ckpt")
    with pytest.raises(UserError, match=r"\(the weights under 'state_dict'\): does not fit this model: '0.weight' is \(64, 32\)"):
        load_model_state(MLP(), tmp_path / "other.ckpt")
    torch.save({"epoch": 1, "step": 2}, tmp_path / "none.ckpt")
    with pytest.raises(UserError, match="none of state_dict, model, model_state_dict, module, net holds the weights"):
        load_model_state(MLP(), tmp_path / "none.ckpt")


def test_random_bytes_are_not_a_checkpoint(tmp_path):
    (tmp_path / "random.pt").write_bytes(bytes(range(7, 250)) * 9)
    with pytest.raises(UserError, match="not a checkpoint: neither torch's zip format nor a pickle") as e:
        load_model_state(MLP(), tmp_path / "random.pt")
    assert "run code" not in str(e.value)


@pytest.mark.parametrize("strategy", ["single", "fsdp"])
def test_an_optimizer_that_keeps_no_state_resumes_exactly(tmp_path, strategy, request):
    """SGD without momentum saves param groups and no state: its resume failed in torch's set_state_dict
    ('Expected device to be set', a traceback, exit 1) until the groups alone were loaded."""
    from tests.conftest import assert_same_weights, train

    if strategy == "fsdp":
        request.getfixturevalue("one_rank")
    sgd = ["optimizer={_target_: torch.optim.SGD, lr: 0.1}", f"strategy={strategy}", "checkpoint.every=10"]
    train(tmp_path / "a", *sgd, "trainer.max_steps=10")
    train(tmp_path / "a", *sgd, "trainer.max_steps=20")
    train(tmp_path / "b", *sgd, "trainer.max_steps=20")
    assert_same_weights(tmp_path / "b" / "model.pt", tmp_path / "a" / "model.pt")
