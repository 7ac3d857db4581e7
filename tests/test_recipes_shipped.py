"""Every recipe shipped under recipes/ loads, validates, and names importable components."""

import contextlib

import pytest
import torch

from launcher.recipe import instantiate, load
from tests.conftest import REPO

RECIPES = sorted((REPO / "recipes").glob("**/*.yaml"))


def test_there_are_recipes():
    assert len(RECIPES) >= 2


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_recipe_loads_and_builds(path, tmp_path):
    overrides = ["on_cpu=null"]  # as written (a recipe's on_cpu keys may rename a run without a GPU)
    # its HF folder, made as its header says
    if path.name in ("hf_finetune.yaml", "hf_lora.yaml", "hf_sft.yaml", "hf_dpo.yaml", "hf_pretrain.yaml"):
        from recipes.components.hf_folder import write

        write(str(tmp_path / "base"))
        inner = "model.model" if path.name == "hf_lora.yaml" else "model"
        overrides.append(f"{inner}.config.pretrained_model_name_or_path={tmp_path / 'base'}")
    loaded = load(path, overrides)
    assert loaded.recipe.name == path.stem
    header = path.read_text().splitlines()[0]
    assert header.startswith("#"), "a recipe starts with a header comment giving the commands that run it"
    assert f"python -m launcher recipes/{path.name}" in path.read_text()
    big = path.name == "llama8b.yaml"  # 32 GB of fp32 weights: built on meta (as the planner builds it)
    with torch.device("meta") if big else contextlib.nullcontext():
        model = instantiate(loaded.recipe.model)  # the model builds as the recipe states it
    assert sum(q.numel() for q in model.parameters()) > (8e9 if big else 0)
    assert len(instantiate(loaded.recipe.data.train)) > 0
