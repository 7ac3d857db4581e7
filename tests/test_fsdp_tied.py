"""Tied weights under fsdp (an input embedding shared with the output layer): the default units never
split them between two FSDP groups, and units a recipe names that would are one line, exit 2."""

import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.hf_tolerance import RECIPE, in_process, overrides
from tests.pace import paced
from tests.rounding import assert_within_rounding
from tests.test_hf_tolerance import exact

transformers = pytest.importorskip("transformers", reason="the dev extra (transformers) is not installed")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fsdp_x2(tmp_path_factory):
    """Each model's fsdp x2 run, one after another in one torchrun launch (tests/several_runs.py): (folder, rank 0's
    results)."""
    from tests.several_runs import several

    root = tmp_path_factory.mktemp("tied")
    cases = {model: [str(RECIPE), f"run_dir={root / model}", *exact(model, "sgd"), "strategy=fsdp"]
             for model in ("bert", "gpt2", "llama")}
    return root, several(cases, root)[0]


@pytest.mark.parametrize("model, units", [
    ("bert", "units BertLayer (BertEmbeddings left to the root: it holds a weight tied to one outside it)"),
    ("gpt2", "units GPT2Block\n"), ("llama", "units LlamaDecoderLayer\n")])
def test_tied_embeddings_under_fsdp_x2_give_one_process_s_weights(model, units, tmp_path, fsdp_x2):
    root, results = fsdp_x2
    assert results[model]["error"] is None, results[model]
    assert units in results[model]["said"], results[model]["said"]
    in_process(tmp_path / "one", exact(model, "sgd"))
    assert_within_rounding(tmp_path / "one" / "model.pt", root / model / "model.pt", steps=6)  # (tests/rounding.py)


def test_units_that_would_split_a_tied_weight_are_one_line_on_every_rank(tmp_path):
    done = subprocess.run([sys.executable, "-m", "launcher", str(RECIPE), f"run_dir={tmp_path}",
                           *overrides("llama", "sgd"), "strategy=fsdp", "nproc_per_node=2",
                           "fsdp.units=[Embedding,LlamaDecoderLayer]"],
                          cwd=REPO, capture_output=True, text=True, timeout=paced(300))
    assert done.returncode == 2, done.stderr[-3000:]
    lines = [x for x in done.stderr.splitlines() if x.startswith("launcher:") or "Traceback" in x]
    assert lines == ["launcher: fsdp.units: 'model.embed_tokens.weight' and 'lm_head.weight' are one tied parameter, "
                     "which these units split between unit Embedding and the root; leave Embedding out of "
                     "fsdp.units, or untie the weights"], done.stderr[-3000:]
