"""The reference's files in the run folder (launcher/run/reference.py): what a run finds there, damaged,
truncated, left by an earlier pass or a killed one, is computed again and said in one line, never read as
values and never a traceback; what it finds whole is read back as written."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from tests.conftest import REPO

pytest.importorskip("transformers", reason="the dev extra (transformers) is not installed")

from launcher.data.collate import Pairs  # noqa: E402
from launcher.data.text import TextDataset  # noqa: E402
from launcher.placement.scheduler import Placement  # noqa: E402
from launcher.preference import DPO  # noqa: E402
from launcher.run import reference  # noqa: E402
from launcher.strategies import create  # noqa: E402

PAIRS = REPO / "recipes" / "data" / "pairs.jsonl"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from recipes.components.hf_folder import write

    path = tmp_path_factory.mktemp("reference-folder") / "tiny"
    write(str(path), layers=1, width=16)
    return path


@pytest.fixture(scope="module")
def model(folder):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32)


def attached(folder, model, run_dir, autocast=contextlib.nullcontext):
    """A fresh dataset of the shipped pairs given the reference by `attach` in `run_dir`: (its values, lines said)."""
    dataset = TextDataset(str(folder), str(PAIRS), format="preference", max_len=128, cache=None)
    said = []
    reference.attach(DPO(), {"data.train": dataset}, model, create("single", Placement()), run_dir, 4, Pairs(),
                     autocast, said.append)
    return dataset.reference, said


def kept(run_dir):
    (found,) = (run_dir / reference.FOLDER).iterdir()
    return found


def truncated(where):
    part = where / "part-0.safetensors"
    part.write_bytes(part.read_bytes()[:1000])


def flipped(where):
    """A byte of the values changed: a file that still reads, of other numbers."""
    part = where / "part-0.safetensors"
    data = bytearray(part.read_bytes())
    data[-3] ^= 0x40
    part.write_bytes(bytes(data))


def a_list_for_a_mark(where):
    (where / "done.json").write_text("[1]\n")


def a_mark_without_its_part(where):
    (where / "part-0.safetensors").unlink()


DAMAGE = {"truncated": truncated, "a byte flipped": flipped, "a list for a mark": a_list_for_a_mark,
          "a part gone": a_mark_without_its_part}


def test_values_kept_whole_are_read_back_as_written(folder, model, tmp_path):
    first, said = attached(folder, model, tmp_path)
    assert any("computed once" in line for line in said), said
    again, said = attached(folder, model, tmp_path)
    assert any("read from" in line for line in said), said
    for (a, b), (c, d) in zip(first, again):
        assert torch.equal(a, c) and torch.equal(b, d)


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_files_are_computed_again_in_one_line_never_read(damage, folder, model, tmp_path):
    first, _ = attached(folder, model, tmp_path)
    DAMAGE[damage](kept(tmp_path))
    again, said = attached(folder, model, tmp_path)
    assert any("are not whole" in line and "computed again" in line for line in said), said
    for (a, b), (c, d) in zip(first, again):
        torch.testing.assert_close(a, c, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(b, d, rtol=1e-12, atol=1e-12)
    _, said = attached(folder, model, tmp_path)  # and what was computed again reads back
    assert any("read from" in line for line in said), said


def bf16():
    return torch.autocast("cpu", dtype=torch.bfloat16)


@pytest.mark.parametrize("other", ["weights", "precision"])
def test_another_runs_reference_copied_here_is_computed_again_never_read(other, folder, model, tmp_path):
    """Another run's folder (its parts and done.json, whole and of the same pairs' lengths) copied over this run's:
    its name proves nothing, done.json says what the values were computed from, and they are not read."""
    import copy
    import shutil

    ours, _ = attached(folder, model, tmp_path / "ours")
    theirs, autocast = copy.deepcopy(model), bf16 if other == "precision" else contextlib.nullcontext
    if other == "weights":
        with torch.no_grad():
            theirs.lm_head.weight.mul_(1.5)
    attached(folder, theirs, tmp_path / "theirs", autocast)
    shutil.copytree(kept(tmp_path / "theirs"), kept(tmp_path / "ours"), dirs_exist_ok=True)
    again, said = attached(folder, model, tmp_path / "ours")
    assert any(f"are not this run's (ValueError: computed from other {other} than this run's, says done.json): "
               f"computed again" in line for line in said), said
    assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(ours, again))
    assert json.loads((kept(tmp_path / "ours") / "done.json").read_text())["computed_from"]["precision"] == "None"


def test_a_part_left_by_an_earlier_pass_is_not_read(folder, model, tmp_path):
    """An earlier pass under more ranks left part-5, of other values; this pass's mark names its own parts alone."""
    first, _ = attached(folder, model, tmp_path)
    where = kept(tmp_path)
    from safetensors.torch import load_file, save_file

    stale = load_file(str(where / "part-0.safetensors"))
    stale["chosen"] = stale["chosen"] + 1.0
    save_file(stale, str(where / "part-5.safetensors"))
    again, said = attached(folder, model, tmp_path)
    assert any("read from" in line for line in said), said
    for (a, b), (c, d) in zip(first, again):
        assert torch.equal(a, c) and torch.equal(b, d)
    assert json.loads((where / "done.json").read_text())["parts"].keys() == {"part-0.safetensors"}


def test_a_model_with_a_scalar_buffer_is_digested_whole(folder, model, tmp_path):
    """A 0-d buffer or parameter (Gemma 3's embed_scale, a learnt temperature) is part of the reference's key,
    as every other tensor: another value of it is another reference."""
    import copy

    scaled = copy.deepcopy(model)
    scaled.register_buffer("scale", torch.tensor(1.0))
    _, said = attached(folder, scaled, tmp_path)
    assert any("computed once" in line for line in said), said
    scaled.scale.fill_(2.0)
    _, said = attached(folder, scaled, tmp_path)
    assert any("computed once" in line for line in said), said
    assert len(list((tmp_path / reference.FOLDER).iterdir())) == 2


def test_the_weights_are_digested_once_for_train_and_val(folder, model, tmp_path, monkeypatch):
    """Digesting the weights reads every one of them (gathered whole where sharded): once a run, not once a
    dataset."""
    calls = []
    digest = reference._digest
    monkeypatch.setattr(reference, "_digest", lambda m: calls.append(1) or digest(m))
    datasets = {name: TextDataset(str(folder), str(PAIRS), format="preference", max_len=max_len, cache=None)
                for name, max_len in (("data.train", 128), ("data.val", 64))}
    reference.attach(DPO(), datasets, model, create("single", Placement()), tmp_path, 4, Pairs(),
                     contextlib.nullcontext, lambda line: None)
    assert all(dataset.reference is not None for dataset in datasets.values())
    assert len(calls) == 1


@pytest.mark.parametrize("failing", ["_write_part", "_mark", "_unmarked"])
def test_a_folder_that_cannot_be_written_is_one_line(folder, model, tmp_path, monkeypatch, failing):
    """A full disk (or any OSError) while the reference is kept: one line naming the folder, through the
    strategy's agreement (every rank stops with it), not a traceback on one rank while the others wait."""
    from launcher.errors import UserError

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(reference, failing, full)
    with pytest.raises(UserError, match=r"reference's log-probabilities cannot be written there: No space left"):
        attached(folder, model, tmp_path / "run")


def test_a_run_resumed_under_another_precision_computes_the_reference_again(folder, model, tmp_path):
    """The values depend on the dtype the forward computes in: kept apart by it, each read back by its own."""
    fp32, said = attached(folder, model, tmp_path)
    assert "computed once" in said[0], said
    in_bf16, said = attached(folder, model, tmp_path, bf16)
    assert "computed once" in said[0], said
    assert len(list((tmp_path / reference.FOLDER).iterdir())) == 2
    def same(x, y):
        return len(x) == len(y) and all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(x, y))

    assert not same(fp32, in_bf16)  # bf16's matmuls: other values
    for autocast, values in ((contextlib.nullcontext, fp32), (bf16, in_bf16)):
        again, said = attached(folder, model, tmp_path, autocast)
        assert "read from" in said[0] and same(again, values), said
