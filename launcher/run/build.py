"""Building the run's parts from their recipe sections: each component by `_target_`, checked as soon as
it is built; the step; the data."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch

from launcher.data import sampling as data
from launcher.data import loaders
from launcher.data import stream
from launcher.model import step as steps
from launcher.data.collate import Collate
from launcher.errors import UserError, first_line
from launcher.recipe import instantiate
from launcher.recipe.built import check as check_built
from launcher.recipe.instantiate import UnexpectedArgument, locate
from launcher.recipe.schema import DataConfig


def step(spec: Optional[Dict[str, Any]], loss: Optional[Dict[str, Any]]):
    """The recipe's step, given the recipe's loss when it takes one; without a step, the shipped one
    that fits: the supervised step with a loss, the model's own loss without."""
    if spec is None:
        return steps.select(component(loss, "loss") if loss is not None else None)
    if loss is not None and "loss" not in spec:
        target = locate(spec["_target_"])
        try:
            takes = "loss" in inspect.signature(target).parameters
        except (TypeError, ValueError):
            takes = False
        if not takes:
            raise UserError(f"loss: unused: step {spec['_target_']} takes no loss argument; remove loss:, or give "
                            f"the step the arguments it takes")
        spec = {**spec, "loss": loss}
    return component(spec, "step")


def component(spec: Dict[str, Any], key: str, *args: Any) -> Any:
    """Build a recipe component and check it is what its section needs. A constructor that rejects the
    recipe's arguments (a negative size, a value out of its range) is the recipe's mistake: one line naming
    the key, not a traceback."""
    _model_folders_here(spec, key)
    try:
        built = instantiate(spec, *args, key=key)
    except UnexpectedArgument as e:  # a keyword the call refused, which its signature could not show
        raise UserError(f"{e.argument}: {e}") from None
    except (TypeError, ValueError, RuntimeError, OSError) as e:  # OSError: a path that is not there (a model folder)
        raise UserError(f"{key}: {spec['_target_']} failed with the recipe's arguments: "
                        f"{type(e).__name__}: {first_line(e)}") from None
    except SystemExit as e:  # sys.exit() in a constructor would end the run with its code and no model
        raise UserError(f"{key}: {spec['_target_']} raised SystemExit({e.code!r}) while being built; a component "
                        f"must not exit the process (raise an exception instead)") from None
    except Exception as e:
        # Anything else (KeyError, AttributeError, an assert, an import inside it) is taken for a bug in
        # the component: its traceback is what its author needs, with the recipe key it was built for.
        if hasattr(e, "add_note"):  # Python 3.11+
            e.add_note(f"launcher: raised while building {key} ({spec['_target_']}) from the recipe")
        raise
    check_built(key, spec["_target_"], built)
    return built


def _model_folders_here(spec: Any, key: str) -> None:
    """A pretrained_model_name_or_path that names a local folder (./, /, ~, more than OWNER/NAME, or inside a
    folder that is here) is there: one line now, where transformers would first ask the Hub for a repo of that
    name (which waits for the network before it says anything)."""
    if isinstance(spec, dict):
        for name, value in spec.items():
            if name == "pretrained_model_name_or_path" and isinstance(value, str) and _missing_folder(value):
                there = next(p for p in Path(value).expanduser().absolute().parents if p.is_dir())
                raise UserError(f"{key}.{name}: {value}: no such folder (the nearest that is there: {there}); name "
                                f"a model folder as save_pretrained writes it, or a Hub repo id (NAME or OWNER/NAME)")
            _model_folders_here(value, f"{key}.{name}")
    elif isinstance(spec, (list, tuple)):
        for i, value in enumerate(spec):
            _model_folders_here(value, f"{key}.{i}")


def _missing_folder(name: str) -> bool:
    """A name that says a local path (a Hub repo id is NAME or OWNER/NAME, neither inside a folder here) which
    is not there."""
    path = Path(name).expanduser()
    if path.exists():
        return False
    parts = Path(name).parts
    return (name.startswith(("./", "../", "/", "~")) or name in (".", "..") or len(parts) > 2
            or (len(parts) == 2 and Path(parts[0]).is_dir()))


def optimizer(spec: Dict[str, Any], params: list) -> Tuple[Any, Optional[str]]:
    """The recipe's optimizer over `params`, and a line naming its implementation when the launcher chose it.

    A torch optimizer with a fused implementation (Adam, AdamW, SGD, Adagrad), where the recipe names neither
    `fused` nor `foreach`, gets `fused=True` where its fused kernel can step these parameters (`fused_steps`):
    HF Trainer picks adamw_torch_fused for its users, torchtitan `implementation: fused`. torch's own default
    is a loop over the tensors on the CPU and `foreach` on CUDA. A checkpoint's optimizer state says how its
    run stepped, and a resumed run steps the same way where it can (`implementation_resumed`)."""
    target = locate(spec["_target_"])
    if spec.get("fused") is True and _torch_optimizer(target) and _sharded(params) and not _fused_kernel_shards(target):
        raise UserError(f"optimizer.fused: true, and {spec['_target_']}'s fused kernel cannot step this layout's "
                        f"sharded parameters (torch {torch.__version__.split('+')[0]}'s DTensor has no rule for it); "
                        f"set optimizer.fused=false, or leave it out and the launcher picks")
    if _fusable(spec, params):
        built = component({**spec, "fused": True}, "optimizer", params)
        where = sorted({q.device.type for q in params})
        return built, (f"optimizer: {spec['_target_']} with fused=True, torch's fastest implementation on "
                       f"{', '.join(where)} (optimizer.fused=false keeps torch's default)")
    return component(spec, "optimizer", params), None


def implementation_resumed(optimizer: Any) -> Optional[str]:
    """After a resume, the implementation the optimizer steps with, and a line when it is not the one it was built
    with. The checkpoint's (its param groups, loaded, carry `fused`) where this layout can run it, so that the run
    goes on as it started and ends exactly; where it cannot (a one-process run's fused SGD resumed under fsdp or
    tp, whose DTensors have no rule for it), the one this layout built, as a fresh run here steps."""
    built, groups = getattr(optimizer, "defaults", {}).get("fused"), getattr(optimizer, "param_groups", [])
    loaded = groups[0].get("fused") if groups else None
    if bool(built) == bool(loaded):
        return None
    params = [q for group in groups for q in group["params"]]
    if loaded and not fused_steps(type(optimizer), params):
        for group in groups:
            group["fused"], group["foreach"] = built, optimizer.defaults.get("foreach")
        why = ("this layout's sharded parameters (torch's DTensor has no rule for its fused kernel)" if _sharded(params)
               else "these parameters (no fused kernel for their devices or dtypes)")
        said = (f"optimizer: its checkpoint stepped with fused=True, which {type(optimizer).__name__} cannot on {why}; "
                f"it goes on with torch's default (fused=False), as a fresh run here does, which rounds apart in the "
                f"last bits")
    else:
        said = (f"optimizer: resumed with its checkpoint's implementation (fused={bool(loaded)}), as the run "
                f"started, so that it continues exactly")
    # GradScaler hands a fused step its scale (fp16); torch's loop over the tensors refuses one.
    optimizer._step_supports_amp_scaling = bool(groups[0]["fused"])
    return said


def fused_steps(target: type, params: list) -> bool:
    """The one rule for the fused implementation: whether optimizer class `target` has a fused kernel that can
    step `params`, a fresh run's as a resumed one's. It must take `fused`, every parameter be floating point on
    a device torch has fused kernels for (the CPU included), and sharded parameters (DTensors: FSDP2's shards,
    tensor parallel's splits) have a DTensor sharding rule for the kernel: torch 2.13 has Adam's and AdamW's,
    not SGD's or Adagrad's, whose first step would fail ('aten._fused_sgd_.default does not have a sharding
    strategy registered')."""
    try:
        takes = "fused" in inspect.signature(target).parameters
        from torch.optim.optimizer import _get_fused_kernels_supported_devices

        devices = set(_get_fused_kernels_supported_devices())
    except (TypeError, ValueError, ImportError):
        return False
    if not (params and takes and all(torch.is_floating_point(q) and q.device.type in devices for q in params)):
        return False
    return not _sharded(params) or _fused_kernel_shards(target)


def _fusable(spec: Dict[str, Any], params: list) -> bool:
    """Whether the launcher chooses fused: the recipe left the implementation to it, and the rule allows it."""
    if not params or any(key in spec for key in ("fused", "foreach", "differentiable")):
        return False
    target = locate(spec["_target_"])
    return _torch_optimizer(target) and fused_steps(target, params)


def _torch_optimizer(target: Any) -> bool:
    return (isinstance(target, type) and issubclass(target, torch.optim.Optimizer)
            and target.__module__.startswith("torch.optim."))


def _sharded(params: list) -> bool:
    return any(type(q).__name__ == "DTensor" for q in params)


def _fused_kernel_shards(target: type) -> bool:
    """Whether DTensor has a sharding rule for the optimizer's fused kernel (looked up, not assumed: a later
    torch may add SGD's and Adagrad's)."""
    try:
        from torch.distributed.tensor import DTensor

        op = getattr(torch.ops.aten, f"_fused_{target.__name__.lower()}_").default
        propagator = DTensor._op_dispatcher.sharding_propagator
        known = (getattr(propagator, name, {}) for name in ("op_strategy_funcs", "op_to_rules",
                                                             "op_single_dim_strategy_funcs"))
        return any(op in table for table in known)
    except (AttributeError, ImportError, RuntimeError):
        return False


def data_for(cfg: DataConfig, grad_accum: int, share: Tuple[int, int], seed: int, device: torch.device,
             world: Optional[int] = None, model: Optional[torch.nn.Module] = None,
             val_share: Optional[Tuple[int, int]] = None):
    """The training stream of this rank, its validation batches (or None), and the datasets' lines for the
    console: its share of each batch, one of `share` = (how many ranks read their own, this rank's place among
    them), of `world` processes; of data.val, one of `val_share` (default: `share`), in batches of as many items a
    rank as training's. A dataset with `notes` (a list of lines: what it read and made, as
    launcher.data.text.TextDataset has) gets them said at start, under its key; one with `check_vocabulary`
    is given `model`'s input embedding rows, and what it says is wrong is one line before the first step."""
    replicas, rank = share
    data.check_batch(cfg.batch_size, replicas, world)
    collate = Collate(component(cfg.collate, "data.collate")) if cfg.collate else None
    workers = loaders.Loading(cfg.num_workers, cfg.persistent_workers, cfg.prefetch_factor, cfg.pin_memory,
                              cfg.multiprocessing_context)
    dataset = component(cfg.train, "data.train")
    if stream.is_stream(dataset):
        train = stream.StreamData(dataset, cfg.batch_size, replicas, rank, workers,
                                  device, collate, seed)
    else:
        train = data.TrainData(dataset, cfg.batch_size, grad_accum, replicas, rank,
                               cfg.shuffle, seed, workers, device, collate)
    val_set = component(cfg.val, "data.val") if cfg.val else None
    val_replicas, val_rank = val_share or share
    val_batch = cfg.batch_size * val_replicas // replicas  # (replica groups: each reads the whole of data.val)
    if stream.is_stream(val_set):
        val = stream.StreamBatches(val_set, val_batch, val_replicas, val_rank, workers,
                                   device, collate, data.to_device, seed)
    else:
        val = data.val_batches(val_set, val_batch, val_replicas, val_rank, workers,
                               device, seed, collate)
    notes = [f"{key}: {line}" for key, built in (("data.train", dataset), ("data.val", val_set))
             for line in _notes(built)]
    rows = _embedding_rows(model)
    for key, built in (("data.train", dataset), ("data.val", val_set)):
        check = getattr(built, "check_vocabulary", None)
        problem = check(rows) if rows is not None and callable(check) else None
        if problem:
            raise UserError(f"{key}: {problem}")
    return train, val, notes


def _embedding_rows(model: Optional[torch.nn.Module]) -> Optional[int]:
    """The rows of the model's input embedding (the token ids it takes), where it says (transformers' models,
    peft's): None otherwise."""
    getter = getattr(model, "get_input_embeddings", None)
    try:
        embedding = getter() if callable(getter) else None
    except (NotImplementedError, AttributeError):
        return None
    weight = getattr(embedding, "weight", None)
    return int(weight.shape[0]) if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None


def _notes(dataset: Any) -> list:
    said = getattr(dataset, "notes", None)  # an attribute of that name on another dataset may be anything
    return [line for line in said if isinstance(line, str)] if isinstance(said, (list, tuple)) else []
