"""HF model folders in and out: checkpoint.init_from reads a folder as save_pretrained writes it (one
file, or shards with their index; a bf16 folder into fp32 weights; a tied output layer the folder leaves
out), under every strategy; python -m launcher.export --format hf writes a folder from_pretrained loads,
with the trained model's logits."""

import json
import re
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO, launch, state_dict
from tests.pace import paced
from tests.rounding import assert_within_rounding, float64

transformers = pytest.importorskip("transformers", reason="the dev extra (transformers) is not installed")
pytest.importorskip("safetensors", reason="the dev extra (safetensors) is not installed")

RECIPE = REPO / "recipes" / "hf_finetune.yaml"
SHORT = ["on_cpu=null", "precision=fp32", "trainer.max_steps=6", "trainer.log_every=3", "trainer.eval_every=null",
         "checkpoint.every=null", "logging.tensorboard=false", "logging.progress_bar=false", "data.val=null",
         "trainer.activation_checkpointing=null", "data.batch_size=8", "optimizer._target_=torch.optim.SGD",
         "optimizer.lr=0.5", "~optimizer.weight_decay",
         # no memory planner beside each run (a process of its own): no test here reads the `memory:` line
         "logging.memory_plan=false"]
# the runs compared within rounding (tests/rounding.py)
EXACT = float64("transformers.AutoModelForCausalLM.from_config")


def folder(tmp_path, name="base", **kwargs):
    from recipes.components.hf_folder import write

    path = tmp_path / name
    write(str(path), **kwargs)
    return path


def overrides(base, run_dir, *extra):
    return [f"model.config.pretrained_model_name_or_path={base}", f"run_dir={run_dir}",
            *[o for o in SHORT if not o.startswith("~")], "optimizer={_target_: torch.optim.SGD, lr: 0.5}", *extra]


def here(base, run_dir, *extra):
    from launcher.recipe import load
    from launcher.run.train import train

    return train(load(RECIPE, overrides(base, run_dir, *extra)))


def test_a_sharded_folder_and_a_single_file_initialise_the_same_model(tmp_path, capsys):
    one = folder(tmp_path, "one")
    sharded = folder(tmp_path, "sharded", shard_size="60KB")
    assert len(list(sharded.glob("model-*.safetensors"))) > 1 and (sharded / "model.safetensors.index.json").is_file()
    here(one, tmp_path / "a", "trainer.max_steps=1", "optimizer.lr=0.0")
    assert f"initialised the model from {one}" in capsys.readouterr().out
    here(sharded, tmp_path / "b", "trainer.max_steps=1", "optimizer.lr=0.0")
    base = transformers.AutoModelForCausalLM.from_pretrained(one).state_dict()
    for run in ("a", "b"):
        got = state_dict(tmp_path / run / "model.pt")
        assert got.keys() == base.keys() and all(torch.equal(got[k], base[k]) for k in base), run


def test_a_bf16_folder_loads_into_fp32_weights_and_a_tied_output_layer_is_filled(tmp_path):
    bf16 = folder(tmp_path, "bf16", dtype="bf16", tie=True)
    saved = transformers.AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.bfloat16).state_dict()
    here(bf16, tmp_path / "run", "trainer.max_steps=1", "optimizer.lr=0.0")
    got = state_dict(tmp_path / "run" / "model.pt")
    assert got["model.embed_tokens.weight"].dtype == torch.float32
    assert all(torch.equal(got[k], saved[k].float()) for k in saved)
    assert torch.equal(got["lm_head.weight"], got["model.embed_tokens.weight"])  # tied, not in the folder


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """Each strategy's run of two processes from its folder, one after another in one torchrun launch
    (tests/several_runs.py): (the folders, rank 0's results). Under fsdp, a bf16 folder with a tied output layer."""
    from tests.several_runs import several

    root = tmp_path_factory.mktemp("two")
    plain, tied = folder(root, "plain", shard_size="60KB"), folder(root, "tied", shard_size="60KB", dtype="bf16", tie=True)
    lr = ["optimizer.lr=0.1"]  # the tied-weights tests' (tests/test_fsdp_tied.py)
    cases = {"ddp": overrides(plain, root / "ddp", "strategy=ddp", *EXACT),
             "fsdp": overrides(tied, root / "fsdp", "strategy=fsdp", *lr, *EXACT),
             "fsdp-tp": overrides(tied, root / "fsdp-tp", "strategy=fsdp", "parallel.tp=2", *lr, *EXACT)}
    return root, several({name: [str(RECIPE), *args] for name, args in cases.items()}, root)[0]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "fsdp-tp"])
def test_two_processes_from_a_folder_end_as_one(tmp_path, strategy, two_processes):
    """Under fsdp each rank reads its slices into shards of a model built on the meta device: here a bf16
    folder with a tied output layer, in shards with their index, at the learning rate of the tied-weights
    tests (tests/test_fsdp_tied.py: a tied gradient is summed in another order over two ranks). fsdp-tp: the
    Llama's own tensor-parallel plan (tp 2), its tied embedding and output head split on the vocabulary."""
    root, results = two_processes
    tied = strategy != "ddp"
    base = root / ("tied" if tied else "plain")
    here(base, tmp_path / "one", *(["optimizer.lr=0.1"] if tied else []), *EXACT)
    done = results[strategy]
    assert done["error"] is None, done
    assert (f"initialised the model from {base} into this rank's shards" in done["said"]) == tied
    if strategy == "fsdp-tp":
        assert "parallel.tp: 16 layers split over 2 ranks: lm_head (colwise_rep), model.embed_tokens " \
               "(embedding_rowwise), model.layers.0.self_attn.q_proj (colwise)" in done["said"], done["said"]
    assert_within_rounding(tmp_path / "one" / "model.pt", root / strategy / "model.pt", steps=6)


@pytest.mark.slow
@pytest.mark.measuring
def test_no_rank_holds_the_whole_model_to_load_it_nor_export_to_write_it(tmp_path):
    """The pretrained row of python -m launcher.bench at 55M parameters (6 layers of 1024, 219 MB in fp32):
    rank 0's peak host memory under fsdp x2 once loaded <= (the fp32 model's bytes / 2) x 1.15 + a process's
    without a model (the same run of a model of 1 layer of width 16); built whole on every rank
    (fsdp.empty_init=false), as before, it is not. Export --format hf of the run's sharded checkpoint in
    shards of 20 MB holds less than half the model more than the same export of the small model."""
    from argparse import Namespace

    from launcher.bench.layouts.pretrained import pretrained

    out = "\n".join(pretrained(Namespace(run_dir=str(tmp_path), pretrained_layers=6, pretrained_width=1024)))
    meta = re.search(r"^built on meta, slices read +(\d+) MiB  \(bound (\d+) MiB: (met|NOT met)\)$", out, re.M)
    whole = re.search(r"^built whole on every rank +(\d+) MiB", out, re.M)
    assert meta and meta.group(3) == "met" and whole and int(whole.group(1)) > int(meta.group(2)), out
    model_bytes = sum(f.stat().st_size for f in (tmp_path / "big").glob("*.safetensors"))
    tiny, big = export_peaks((tmp_path / "tiny_run", tmp_path / "tiny_hf"), (tmp_path / "empty_run", tmp_path / "big_hf"))
    exported = big - tiny
    assert len(list((tmp_path / "big_hf").glob("model-*.safetensors"))) > 5
    assert exported < model_bytes / 2 / 2**20, exported


def export_peaks(*runs) -> list:
    """python -m launcher.export RUN OUT --format hf --max-shard-size 20MB of each (RUN, OUT), one after another in
    one process of its own: its peak host memory (MiB) after each. A peak never falls, so the big export after the
    tiny one adds to it what the big one holds beyond the tiny one's (the process's imports paid once)."""
    # VmHWM (kB), this process image's own peak: ru_maxrss would keep the forking pytest worker's across the exec
    code = ("import re, sys; from launcher.export import main\n"
            "for run, out in zip(sys.argv[1::2], sys.argv[2::2]):\n"
            "    code = main([run, out, '--format', 'hf', '--max-shard-size', '20MB'])\n"
            "    peak = re.search(r'^VmHWM:\\s+(\\d+) kB$', open('/proc/self/status').read(), re.M).group(1)\n"
            "    print('PEAK', code, peak, flush=True)")
    done = subprocess.run([sys.executable, "-c", code, *(str(p) for run in runs for p in run)], cwd=REPO,
                          capture_output=True, text=True, timeout=paced(300))
    peaks = re.findall(r"^PEAK (-?\d+) (\d+)$", done.stdout, re.M)
    assert done.returncode == 0 and len(peaks) == len(runs) and all(code == "0" for code, _ in peaks), \
        done.stdout[-2000:] + done.stderr[-3000:]
    assert all((run_dir / "checkpoints").is_dir() for run_dir, _ in runs)
    return [int(peak) / 1024 for _, peak in peaks]


def export(*args) -> subprocess.CompletedProcess:
    """python -m launcher.export ARGS run in this process (tests/test_export.py runs the command itself): its
    exit code, stdout and stderr."""
    import contextlib
    import io

    from launcher.export import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def assert_the_trained_logits(folder, base, run_dir) -> None:
    """from_pretrained of `folder` gives the logits of the run's model.pt, loaded into a model of `base`'s config."""
    trained = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(base))
    trained.load_state_dict(state_dict(run_dir / "model.pt"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, trained(ids).logits, rtol=0, atol=1e-6)


def test_export_as_an_hf_folder_gives_from_pretrained_the_trained_logits(tmp_path):
    base = folder(tmp_path)
    here(base, tmp_path / "run", "checkpoint.every=3")
    assert json.loads((tmp_path / "run" / "hf_config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    done = export(tmp_path / "run", tmp_path / "out", "--format", "hf", "--max-shard-size", "60KB")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file() and "config.json" in done.stdout
    assert_the_trained_logits(tmp_path / "out", base, tmp_path / "run")
    # bf16, from a checkpoint folder: the run folder's config is found from it
    done = export(tmp_path / "run" / "checkpoints" / "step_3", tmp_path / "bf16", "--format", "hf", "--dtype", "bf16")
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16").dtype == torch.bfloat16


def test_a_run_can_end_with_its_hf_folder(tmp_path, capsys):
    base = folder(tmp_path)
    here(base, tmp_path / "run", "checkpoint.export_hf=true")
    assert f"HF folder: {tmp_path / 'run' / 'hf'}" in capsys.readouterr().out
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf").state_dict()
    trained = state_dict(tmp_path / "run" / "model.pt")
    assert all(torch.equal(loaded[k], trained[k]) for k in trained)
    here(base, tmp_path / "run", "checkpoint.export_hf=true", "trainer.max_steps=8")  # continued: replaced
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf").state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in state_dict(tmp_path / "run" / "model.pt").items())


def test_export_mistakes_are_one_line(tmp_path):
    base = folder(tmp_path)
    torch.save(transformers.AutoModelForCausalLM.from_pretrained(base).state_dict(), tmp_path / "weights.pt")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("")
    for args, says in (
        ([tmp_path / "weights.pt", tmp_path / "o1", "--format", "hf"], "--format hf needs the model's config"),
        ([base, tmp_path / "taken", "--format", "hf"], "exists and is not an empty folder"),
        ([base, tmp_path / "o2", "--format", "hf", "--max-shard-size", "lots"], "--max-shard-size lots: give a size"),
    ):
        done = export(*args)
        assert done.returncode == 2 and len(done.stderr.splitlines()) == 1 and says in done.stderr, done.stderr
    done = export(tmp_path / "weights.pt", tmp_path / "o3", "--format", "hf", "--config", base / "config.json")
    assert done.returncode == 0, done.stderr  # a plain file, with the config named


@pytest.mark.slow  # a longer run: left out of the fast tier (-m "not slow")
def test_a_folder_of_another_model_names_the_key(tmp_path):
    other = tmp_path / "other"
    from recipes.components.hf_folder import write

    write(str(other), width=32)
    done = launch(str(RECIPE), *overrides(folder(tmp_path), tmp_path / "run", f"checkpoint.init_from={other}"))
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].startswith(f"launcher: checkpoint.init_from: {other}: does not fit "
                                                          f"this model: 'model.embed_tokens.weight' is (256, 32)")
