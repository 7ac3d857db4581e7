"""python -m launcher.export: any checkpoint (sharded or not, a step folder, a run folder, a file) as one
plain .pt or .safetensors file that loads into the plain model with strict=True."""

import subprocess
import sys

import pytest
import torch

from recipes.components.gpt import GPT
from recipes.components.mlp import MLP
from tests.conftest import REPO, assert_same_weights, state_dict, train
from tests.pace import paced

safetensors = pytest.importorskip("safetensors.torch", reason="the dev extra (safetensors) is not installed")


def command(*args):
    """`python -m launcher.export ARGS` in a fresh process, as a user types it."""
    return subprocess.run([sys.executable, "-m", "launcher.export", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=paced(120))


def export(*args):
    """The command's own main() in this process (a fresh one would add its start-up): its exit code, what it
    printed on stdout and on stderr. An exception it let through fails the test, as a traceback would."""
    import contextlib
    import io

    from launcher.export import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A sharded run (fsdp as a torchrun world of one, model.pt gathered at every save) and a full one."""
    folder = tmp_path_factory.mktemp("export")
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.MonkeyPatch.context() as mp:
        for var, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
            mp.setenv(var, value)
        train(folder / "sharded", "strategy=fsdp", "devices=cpu", "checkpoint.every=40", "checkpoint.consolidate=every")
    train(folder / "full", "checkpoint.every=40")
    return folder


@pytest.mark.slow  # over 3 s on a quiet machine: left out of the fast tier (-m 'not slow')
@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_a_sharded_checkpoint_exports_to_the_gathered_weights(runs, tmp_path, suffix):
    step = runs / "sharded" / "checkpoints" / "step_40"
    done = command(step, tmp_path / f"m{suffix}")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"wrote {tmp_path / f'm{suffix}'}: 6 tensors, ") and str(step) in done.stdout
    loaded = safetensors.load_file(tmp_path / "m.safetensors") if suffix == ".safetensors" else state_dict(tmp_path / "m.pt")
    MLP().load_state_dict(loaded, strict=True)
    expected = state_dict(step / "model.pt")
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)


def test_a_full_checkpoint_a_run_folder_and_a_file_export(runs, tmp_path):
    for source, name in ((runs / "full" / "checkpoints" / "step_40", "a.pt"), (runs / "full", "b.pt"),
                         (runs / "full" / "model.pt", "c.pt")):
        assert export(source, tmp_path / name).returncode == 0
    assert_same_weights(runs / "full" / "checkpoints" / "step_40" / "model.pt", tmp_path / "a.pt")
    assert_same_weights(runs / "full" / "model.pt", tmp_path / "b.pt")
    assert_same_weights(runs / "full" / "model.pt", tmp_path / "c.pt")


def test_tied_embeddings_load_strictly_from_safetensors(tmp_path):
    model = GPT(vocab_size=65, block_size=16, n_layer=1, n_head=2, n_embd=16, dropout=0.0, bias=False)
    torch.save(model.state_dict(), tmp_path / "tied.pt")
    assert export(tmp_path / "tied.pt", tmp_path / "tied.safetensors").returncode == 0
    fresh = GPT(vocab_size=65, block_size=16, n_layer=1, n_head=2, n_embd=16, dropout=0.0, bias=False)
    fresh.load_state_dict(safetensors.load_file(tmp_path / "tied.safetensors"), strict=True)
    assert fresh.lm_head.weight.data_ptr() == fresh.transformer.wte.weight.data_ptr()  # still tied


def test_mistakes_are_one_line(runs, tmp_path):
    import shutil

    damaged = tmp_path / "damaged"
    shutil.copytree(runs / "sharded" / "checkpoints" / "step_40", damaged)
    shard = damaged / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    incomplete = tmp_path / "incomplete"
    shutil.copytree(runs / "sharded" / "checkpoints" / "step_40", incomplete)
    (incomplete / "manifest.json").unlink()
    for args, says in (((damaged, tmp_path / "o.pt"), "__0_0.distcp: CRC-32"),
                       ((incomplete, tmp_path / "o.pt"), "no valid manifest.json"),
                       ((tmp_path / "nothing", tmp_path / "o.pt"), "no such file or folder"),
                       ((runs / "full", tmp_path / "o.bin"), "must end in .pt or .safetensors"),
                       ((runs / "full", tmp_path / "no" / "such" / "o.pt"), "cannot write")):
        done = export(*args)
        assert done.returncode == 2 and says in done.stderr and "Traceback" not in done.stderr, (args, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1


class Crafted:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_a_crafted_metadata_file_is_refused_and_never_run(runs, tmp_path):
    """DCP's own reader would unpickle .metadata with pickle.load; a forged manifest matches any file."""
    import json
    import pickle
    import shutil

    from launcher.checkpoint import crc32

    crafted = tmp_path / "step_40"
    shutil.copytree(runs / "sharded" / "checkpoints" / "step_40", crafted)
    (crafted / ".metadata").write_bytes(pickle.dumps(Crafted()))
    manifest = json.loads((crafted / "manifest.json").read_text())
    manifest["files"][".metadata"] = {"size": (crafted / ".metadata").stat().st_size, "crc32": crc32(crafted / ".metadata")}
    (crafted / "manifest.json").write_text(json.dumps(manifest))
    done = export(crafted, tmp_path / "o.pt")
    assert done.returncode == 2 and "this must never run" not in done.stdout + done.stderr
    assert "names builtins.print, which is not part of DCP's metadata" in done.stderr, done.stderr
    from launcher.errors import UserError

    with pytest.raises(UserError, match="not part of DCP's metadata"):  # resume reads it the same way
        from launcher.checkpoint import sharded

        sharded.read(crafted, {"model": {}})


def test_init_from_a_sharded_checkpoint(runs, tmp_path):
    values = train(tmp_path, f"checkpoint.init_from={runs / 'sharded' / 'checkpoints' / 'step_40'}",
                   "trainer.max_steps=1", "optimizer.lr=0.0")
    assert values
    assert_same_weights(runs / "sharded" / "checkpoints" / "step_40" / "model.pt", tmp_path / "model.pt")


def test_a_run_folder_continued_and_killed_gives_its_newest_weights(tmp_path, capsys):
    """Finished at step 20, continued to 60 and killed (SIGKILL) at step 45: export and init_from of the run
    folder used to give the step-20 model.pt. The continued run moved that model.pt aside as it began, and
    a run folder's weights are its newest complete checkpoint, step 40, which both name."""
    from tests.conftest import QUICKSTART, SMALL, launch

    run = tmp_path / "run"
    common = [str(QUICKSTART), *SMALL, f"run_dir={run}", "checkpoint.every=20"]
    train(run, "checkpoint.every=20", "trainer.max_steps=20")  # common's run, in this process
    ended = state_dict(run / "model.pt")
    killed = launch(*common, "trainer.max_steps=60",
                    f"model={{_target_: tests.components.KilledOnce, at: 25, marker: '{tmp_path / 'killed'}'}}")
    assert killed.returncode == -9, killed.stderr[-2000:]
    moved = list(run.glob("replaced/*/model.pt"))
    assert len(moved) == 1 and not (run / "model.pt").exists(), killed.stdout[-2000:]
    assert f"{run / 'model.pt'} holds the weights where an earlier run ended, at step 20 or before: moved to {moved[0]}" \
           in killed.stdout
    assert all(torch.equal(ended[k], v) for k, v in state_dict(moved[0]).items())
    done = export(run, tmp_path / "out.pt")
    assert done.returncode == 0 and done.stdout.strip().endswith(f"from {run / 'checkpoints' / 'step_40'}"), done.stderr
    assert_same_weights(run / "checkpoints" / "step_40" / "model.pt", tmp_path / "out.pt")
    capsys.readouterr()
    train(tmp_path / "other", "trainer.max_steps=1", f"checkpoint.init_from={run}")  # in this process
    started = capsys.readouterr()
    assert f"initialised the model from {run} (its weights in {run / 'checkpoints' / 'step_40'})" in started.out, \
        started.err[-2000:]
