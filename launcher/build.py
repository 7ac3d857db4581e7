"""Building the run's parts from their recipe sections: each component by `_target_`, checked as soon as
it is built; the step; the data."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch

from launcher import data, loaders, stream
from launcher import step as steps
from launcher.collate import Collate
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
    `fused` nor `foreach`, gets `fused=True` when every parameter allows it (floating point, on a device torch
    has fused kernels for, the CPU included): HF Trainer picks adamw_torch_fused for its users, torchtitan
    `implementation: fused`. torch's own default is a loop over the tensors on the CPU and `foreach` on
    CUDA. Every strategy meets parameters of the same devices and dtypes, so every one chooses alike; a
    checkpoint's optimizer state says how its run stepped, and a resumed run steps the same way."""
    if _fusable(spec, params):
        built = component({**spec, "fused": True}, "optimizer", params)
        where = sorted({q.device.type for q in params})
        return built, (f"optimizer: {spec['_target_']} with fused=True, torch's fastest implementation on "
                       f"{', '.join(where)} (optimizer.fused=false keeps torch's default)")
    return component(spec, "optimizer", params), None


def implementation_resumed(optimizer: Any) -> Optional[str]:
    """After a resume: a line when the checkpoint's optimizer stepped otherwise than this one was built to
    (its param groups, loaded, carry `fused`): the run goes on as it started, so that it ends exactly."""
    built, groups = getattr(optimizer, "defaults", {}).get("fused"), getattr(optimizer, "param_groups", [{}])
    loaded = groups[0].get("fused") if groups else None
    if bool(built) == bool(loaded):
        return None
    return (f"optimizer: resumed with its checkpoint's implementation (fused={bool(loaded)}), as the run "
            f"started, so that it continues exactly")


def _fusable(spec: Dict[str, Any], params: list) -> bool:
    if not params or any(key in spec for key in ("fused", "foreach", "differentiable")):
        return False
    target = locate(spec["_target_"])
    if not (isinstance(target, type) and issubclass(target, torch.optim.Optimizer)
            and target.__module__.startswith("torch.optim.")):
        return False
    try:
        takes = "fused" in inspect.signature(target).parameters
        from torch.optim.optimizer import _get_fused_kernels_supported_devices

        devices = set(_get_fused_kernels_supported_devices())
    except (TypeError, ValueError, ImportError):
        return False
    if not (takes and all(torch.is_floating_point(q) and q.device.type in devices for q in params)):
        return False
    return not _sharded(params) or _fused_kernel_shards(target)


def _sharded(params: list) -> bool:
    return any(type(q).__name__ == "DTensor" for q in params)


def _fused_kernel_shards(target: type) -> bool:
    """Whether DTensor can run the optimizer's fused kernel on sharded parameters (FSDP2's): torch 2.13 has
    sharding rules for Adam's and AdamW's, not SGD's or Adagrad's, which fail at the first step."""
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
             world: Optional[int] = None):
    """The training stream of this rank, and its validation batches (or None): its share of each batch, one of
    `share` = (how many ranks read their own, this rank's place among them), of `world` processes."""
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
    if stream.is_stream(val_set):
        val = stream.StreamBatches(val_set, cfg.batch_size, replicas, rank, workers,
                                   device, collate, data.to_device, seed)
    else:
        val = data.val_batches(val_set, cfg.batch_size, replicas, rank, workers,
                               device, seed, collate)
    return train, val
