"""The model a run trains, from its recipe to the strategy's wrapper: built at the recipe's seed, its HF
config kept for export, initialised from checkpoint.init_from, its named layers recomputing their
activations, checked on the first batch, wrapped.

Under fsdp with init_from the model is built on the meta device (launcher/model/empty.py), sharded, and each
rank allocates its shards and reads their slices of the pretrained weights: no rank holds the whole
model. Otherwise every rank builds the whole model as one process does (the same random numbers, so
from-scratch weights are those of one process, bitwise), on its device."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable, List

import torch

from launcher import checkpoint, seeding, strategies
from launcher.checkpoint import hf_generation
from launcher.run import build
from launcher.model import chunked
from launcher.model import empty
from launcher.model import moe
from launcher.model import precision
from launcher.model import recompute
from launcher.errors import UserError


def built(recipe, strategy: strategies.Strategy, run_dir: Path, console, init_from) -> torch.nn.Module:
    """The plain model: on this rank's device, initialised from `init_from`; or with its parameters on the
    meta device where the strategy builds empty, to be allocated and filled by `wrapped`."""
    if recipe.precision == "fp8":
        _fp8_allowed(recipe, strategy)
    seeding.seed_everything(recipe.seed)
    on_meta = strategy.builds_empty(bool(init_from))
    checkpoint.named_configs(recipe.model, "model")  # a model folder's config.json, before transformers reads it
    with empty.parameters_on_meta() if on_meta else contextlib.nullcontext():
        model = build.component(recipe.model, "model")
    if on_meta and checkpoint.is_adapted(model):  # its adapters are not in init_from: built as one process builds them
        console.info("fsdp.empty_init: a peft model's adapters are not in checkpoint.init_from's weights; every rank "
                     "builds the whole model, so that they start as one process's do")
        on_meta = False
        seeding.seed_everything(recipe.seed)
        model = build.component(recipe.model, "model")
    if not on_meta:
        model = model.to(strategy.device)
    if strategy.sharded and str(recipe.model.get("_target_", "")).endswith(".from_pretrained"):
        console.info(f"model: {recipe.model['_target_']} loads the whole model on every rank; under fsdp, build it with "
                     f"from_config and name the folder in checkpoint.init_from (recipes/hf_finetune.yaml), so that "
                     f"each rank reads only its shards")
    model_config = checkpoint.model_config(model)
    if model_config is not None:  # an HF model's config: export --format hf writes it beside the weights
        strategy.agree(lambda: checkpoint.keep_config(run_dir, model_config) if strategy.placement.is_main else None)
        strategy.agree(lambda: hf_generation.keep(run_dir, recipe.checkpoint.init_from, recipe.model, model)
                       if strategy.placement.is_main else None)  # and its generation config, as save_pretrained
    adapters = checkpoint.adapter_config(model)
    if adapters is not None and recipe.checkpoint.export_hf and checkpoint.unmerged(adapters):
        raise UserError(f"checkpoint.export_hf: merges the adapters into the HF folder, and "
                        f"{checkpoint.unmerged(adapters)}; set checkpoint.export_hf=false")
    if adapters is not None:  # a peft model's: export --merge-lora and --format peft read it
        strategy.agree(lambda: checkpoint.keep_adapter_config(run_dir, adapters) if strategy.placement.is_main else None)
    if model_config is None and recipe.checkpoint.export_hf:
        raise UserError(f"checkpoint.export_hf: the model ({type(model).__name__}) has no HF config (model.config), "
                        f"which an HF folder needs; export_hf is for transformers models")
    if recipe.checkpoint.export_hf:  # its tokenizer's files checked now, not found wanting when training is done
        said = strategy.agree(lambda: checkpoint.export_tokenizer(run_dir) if strategy.placement.is_main else None)
        if said:
            console.info(said)
    if init_from and not on_meta:
        _initialised(console, init_from, lambda: checkpoint.load_model_state(model, init_from,
                                                                              map_location=strategy.device))
    said = moe.described(model)
    if said:
        console.info(said)
    if recipe.trainer.activation_checkpointing:
        names = recompute.chosen(model, recipe.trainer.activation_checkpointing)
        count = recompute.apply(model, names)
        console.info(f"activation checkpointing: {count} modules ({', '.join(names)}) recompute their activations in "
                     f"backward")
    if recipe.trainer.loss_chunk:
        console.info(chunked.install(model, recipe.trainer.loss_chunk))
    if recipe.precision == "fp8":
        count = precision.to_float8(model, strategy.sharded)
        console.info(f"precision: fp8: {count} Linear layers multiply in fp8 (torchao Float8Linear, dynamic scaling), "
                     f"the rest computes in bf16")
    return model


def _fp8_allowed(recipe, strategy: strategies.Strategy) -> None:
    precision.check_fp8(strategy.device)
    if recipe.parallel.tp > 1:
        raise UserError("precision: fp8 with parallel.tp > 1 would need torchao's float8 tensor-parallel styles, which "
                        "this launcher does not apply; use parallel.tp=1 (FSDP gathers the weights in fp8), or bf16")


def wrapped(model: torch.nn.Module, strategy: strategies.Strategy, console, init_from,
            check: Callable[[torch.nn.Module], List[str]]) -> torch.nn.Module:
    """The model wrapped by the strategy, checked on the first batch: before wrapping (this process's own
    forward, no collective) where it is whole; after its shards are filled where it was built empty."""
    built_empty = empty.is_empty(model)
    if not built_empty:
        for note in check(model):
            console.info(note)
    out = strategy.wrap(model)
    for note in strategy.wrapped():
        console.info(note)
    if built_empty:
        empty.materialise(model, strategy.device)
        _initialised(console, init_from, lambda: checkpoint.load_into_shards(model, init_from),
                     " into this rank's shards")
    if strategy.sharded and init_from:  # what a rank held to get here (python -m launcher.bench --pretrained)
        console.info(f"host memory: {peak_host_memory() / 2**20:.0f} MiB at most on rank 0 up to here, the pretrained "
                     f"weights loaded" + ("" if built_empty else " (built whole on every rank)"))
    split = getattr(strategy, "split", None)
    if built_empty:  # every rank runs the sharded forward
        for note in strategy.agree(lambda: _split_fits(check, out, whole=False) if split else check(out)):
            console.info(note)
        strategy.after_forward(out)
    elif split:  # the whole model fitted the batch: the split one must too
        strategy.agree(lambda: _split_fits(check, out))
        strategy.after_forward(out)
    return out


def _split_fits(check: Callable[[torch.nn.Module], List[str]], model: torch.nn.Module, whole: bool = True) -> List[str]:
    """The first batch through the model split by parallel.tp_plan: where the whole model took it, a failure
    is the plan's (a colwise output reaching a layer that wants it whole, or a split layer whose model sizes
    tensors by the whole of it). A model built on the meta device was not tried whole: a forward that fails
    names the plan first, and how to tell it from the data's mistake."""
    try:
        return check(model)
    except UserError as e:
        if not whole and ": the first batch gives " not in e.problems[0]:
            raise  # the data's own (its items do not batch), found before the forward
        cause = e.problems[0].split(": the first batch gives ", 1)[-1]
        tried = ("the model fits the first batch whole but not split" if whole else
                 "the first batch does not go through the model split by the plan")
        untried = ("" if whole else "; the model was built on the meta device and not tried whole "
                   "(fsdp.empty_init=false tries it whole first, which tells the plan's mistake from the data's)")
        raise UserError(f"parallel.tp_plan: {tried}: {cause}; either a colwise layer's split output reaches a layer "
                        f"that wants it whole (make that one rowwise, or the colwise one colwise_rep), or the model's "
                        f"code sizes a tensor by the whole layer (by its head count, say): leave that layer out of the "
                        f"plan{untried}") from None


def _initialised(console, init_from, load: Callable, how: str = "") -> None:
    try:
        where = load()
    except UserError as e:
        raise UserError(*(f"checkpoint.init_from: {line}" for line in e.problems), every_rank=e.every_rank) from None
    console.info(f"initialised the model from {init_from}{how}" + (f" ({where})" if where else ""))


def peak_host_memory() -> int:
    """This process's peak resident memory in bytes (Linux reports it in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
