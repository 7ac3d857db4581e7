"""Weights files are untrusted input (issue 34): a safetensors header, an index or a config.json that the
safetensors library (or Python's json) would refuse is one line naming the file and what is wrong, exit 2,
in bounded memory: in one process, under fsdp x2 (every rank reads the headers) and in python -m
launcher.export. Before, such files were read as weights (a negative offset made the header's bytes a
tensor: "loss is inf" at lr 0; two tensors at the same bytes loaded silently), raised TypeError, ValueError
or RecursionError, asked for 32 GiB, or took 2-2.8 GB to parse a 99 MB header (tests/hostile.py)."""

import json
import re
import resource
import subprocess
import sys

import pytest
import torch

from tests import hostile
from tests.conftest import REPO
from tests.pace import paced

pytest.importorskip("transformers", reason="the dev extra (transformers) is not installed")
safetensors = pytest.importorskip("safetensors.torch", reason="the dev extra (safetensors) is not installed")

RECIPE = str(REPO / "recipes" / "hf_finetune.yaml")
SHORT = ["on_cpu=null", "precision=fp32", "trainer.max_steps=1", "trainer.log_every=1", "trainer.eval_every=null",
         "checkpoint.every=null", "logging.tensorboard=false", "logging.progress_bar=false", "data.val=null",
         "trainer.activation_checkpointing=null", "data.batch_size=8", "optimizer.lr=0.0", "logging.memory_plan=false"]
MEMORY = 2 ** 30  # a process's peak resident memory, whichever file it read (a process that trains: ~450 MB)


def good_folder(tmp_path):
    from recipes.components.hf_folder import write

    write(str(tmp_path / "good"))
    return tmp_path / "good"


def train_args(config, weights, run_dir, *extra):
    return [RECIPE, f"model.config.pretrained_model_name_or_path={config}", f"checkpoint.init_from={weights}",
            f"run_dir={run_dir}", *SHORT, *extra]


def launcher_lines(stderr: str) -> list:
    return [line for line in stderr.splitlines() if "launcher:" in line]


def limited():  # a regression fails on its own instead of taking the shared machine's memory
    resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))


@pytest.mark.slow
def test_hostile_files_are_one_line_each_in_one_process_and_in_export(tmp_path):
    """Every case through training (python -m launcher's main: the model from the good folder's config, the
    case as checkpoint.init_from) and export (--format hf, and one .pt file), all in one child process,
    whose peak memory stays under MEMORY."""
    good = good_folder(tmp_path)
    cases = {**hostile.headers(good / "model.safetensors", tmp_path / "headers"), **hostile.folders(good, tmp_path)}
    jobs, expected = [], []
    for name, (path, file, says) in cases.items():
        config = path if name == "deep-config" else good
        jobs.append(["launcher", *train_args(config, path, tmp_path / "runs" / name)])
        key = "model.config.pretrained_model_name_or_path" if name == "deep-config" else "checkpoint.init_from"
        expected.append((name, "train", f"launcher: {key}: {file}: ", says))
        hf_args = [] if path.is_dir() else ["--config", str(good)]
        jobs.append(["launcher.export", str(path), str(tmp_path / "out" / name), "--format", "hf", *hf_args])
        expected.append((name, "export --format hf", f"launcher: {file}: ", says))
        if name != "deep-config":  # a .pt file needs no config
            jobs.append(["launcher.export", str(path), str(tmp_path / "out" / f"{name}.pt")])
            expected.append((name, "export .pt", f"launcher: {file}: ", says))
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    done = subprocess.run([sys.executable, "-m", "tests.hostile", "--run", str(tmp_path / "jobs.json")], cwd=REPO,
                          capture_output=True, text=True, timeout=paced(600), preexec_fn=limited)
    assert done.returncode == 0, done.stderr[-3000:]
    *results, peak = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(expected), done.stdout[-3000:]
    for (name, how, prefix, says), got in zip(expected, results):
        lines = launcher_lines(got["stderr"])
        assert got["code"] == 2 and len(lines) == 1 and "Traceback" not in got["stderr"], (name, how, got["stderr"][-3000:])
        assert lines[0].startswith(prefix) and says in lines[0], (name, how, lines[0])
    assert peak["peak"] < MEMORY, f"peak resident memory {peak['peak'] / 2**20:.0f} MiB"
    assert not (tmp_path / "out").exists()  # export wrote nothing


def launch_measured(*args: str) -> tuple:
    """`python -m launcher ARGS` in a fresh process: its outcome, the peak resident memory of the largest of
    its processes (the workers torchrun starts included). Within a minute on a quiet machine (paced: tests/pace.py): a
    rank left waiting for another would wait for dist_timeout."""
    code = ("import resource, subprocess, sys; done = subprocess.run([sys.executable, '-m', 'launcher', *sys.argv[1:]]); "
            "print('PEAK', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, file=sys.stderr); "
            "sys.exit(done.returncode)")
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True, timeout=paced(60))
    peak = int(re.search(r"^PEAK (\d+)$", done.stderr, re.M).group(1))
    return done, peak


@pytest.mark.slow
def test_a_folder_of_hostile_shards_under_fsdp_x2_is_a_line_each_from_rank_0(tmp_path):
    """Every hostile header as a shard of one folder, its index spreading the model's tensors over them:
    each rank reads every header (fsdp x2, built on the meta device), and each ends with exit 2; rank 0
    says one line per shard, and no rank holds more than MEMORY."""
    good = good_folder(tmp_path)
    folder = tmp_path / "shards"
    cases = hostile.headers(good / "model.safetensors", folder)
    names = [k for k in hostile.read(good / "model.safetensors")[0] if k != "__metadata__"]
    shards = list(cases.values())
    weight_map = {name: shards[i % len(shards)][0].name for i, name in enumerate(names)}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text((good / "config.json").read_text())
    done, peak = launch_measured(*train_args(good, folder, tmp_path / "run", "strategy=fsdp", "nproc_per_node=2"))
    said = launcher_lines(done.stderr)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert len(said) == len(cases), done.stderr[-3000:]  # rank 0's, none from rank 1
    for line, (path, _, says) in zip(said, cases.values()):  # in the index's order of the shards
        assert line.startswith(f"launcher: checkpoint.init_from: {path}: ") and says in line, line
    assert peak < MEMORY, peak / 2**20


@pytest.mark.slow
def test_a_deeply_nested_index_under_fsdp_x2_is_one_line_from_rank_0(tmp_path):
    """(A deeply nested config.json is met by every rank before the model is built, and said as in one
    process: the first test.)"""
    good = good_folder(tmp_path)
    path, file, says = hostile.folders(good, tmp_path)["deep-index"]
    done, peak = launch_measured(*train_args(good, path, tmp_path / "run", "strategy=fsdp", "nproc_per_node=2"))
    said = launcher_lines(done.stderr)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert len(said) == 1 and said[0].startswith(f"launcher: checkpoint.init_from: {file}: ") and says in said[0], \
        done.stderr[-3000:]
    assert peak < MEMORY, peak / 2**20


def test_every_dtype_torch_has_is_read_and_the_sub_byte_ones_are_named(tmp_path, capsys):
    """safetensors' float8, unsigned and complex dtypes were 'not a safetensors tensor'; F4 and F6, which
    torch packs two to a byte, are refused naming the dtype."""
    from launcher.checkpoint import hf
    from launcher.export import main as export

    g = torch.Generator().manual_seed(0)
    values = torch.randn(4, 6, generator=g)
    tensors = {"e4m3": values.to(torch.float8_e4m3fn), "e5m2": values.to(torch.float8_e5m2),
               "c64": torch.complex(values, -values), **{f"u{bits}": torch.randint(0, 2 ** 15, (4, 6), generator=g).to(
                   getattr(torch, f"uint{bits}")) for bits in (16, 32, 64)}}
    safetensors.save_file(tensors, str(tmp_path / "kinds.safetensors"))
    assert export([str(tmp_path / "kinds.safetensors"), str(tmp_path / "kinds.pt")]) == 0, capsys.readouterr().err
    got = torch.load(tmp_path / "kinds.pt", weights_only=True)
    assert all(got[k].dtype == v.dtype and torch.equal(got[k].view(torch.uint8), v.view(torch.uint8))
               for k, v in tensors.items())
    rows = hf.slices(tmp_path / "kinds.safetensors")["e4m3"].read((slice(1, 3),))
    assert torch.equal(rows.view(torch.uint8), tensors["e4m3"][1:3].view(torch.uint8))
    hostile.write(tmp_path / "f4.safetensors", {"x": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}, b"\0")
    assert export([str(tmp_path / "f4.safetensors"), str(tmp_path / "f4.pt")]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (
        f"launcher: {tmp_path / 'f4.safetensors'}: 'x' is stored as F4, which the launcher does not read (it reads "
        f"F64, F32, F16, BF16, F8_E4M3, F8_E5M2, F8_E8M0, F8_E4M3FNUZ, F8_E5M2FNUZ, C64, I64, I32, I16, I8, U64, U32, "
        f"U16, U8, BOOL); convert the file's tensors to one of those"), err


def test_a_json_file_larger_than_any_index_is_refused_without_reading_it_whole(tmp_path):
    """An index or config.json is read into memory to be parsed: one of more than 64 MiB (a sparse file here)
    is one line, after reading 64 MiB of it at most."""
    from launcher.checkpoint import untrusted
    from launcher.errors import UserError

    index = tmp_path / "model.safetensors.index.json"
    with open(index, "wb") as f:
        f.truncate(1 << 40)  # a terabyte that takes no disk
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(UserError, match=re.escape(f"{index}: more than 64 MiB; a safetensors index is a few KB")):
        untrusted.json_file(index, "safetensors index")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200 << 10  # KiB: it read 64 MiB at most
