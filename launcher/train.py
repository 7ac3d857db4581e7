"""One run, end to end: place, build every part from its section of the recipe, resume, train, save."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, Optional

import torch
from omegaconf import OmegaConf
from torch import nn

from launcher import checkpoint, data, loggers, scheduler, seeding, spawn, strategies, throughput
from launcher.checkpoint import Checkpointer
from launcher.errors import UserError, first_line
from launcher.loop import Parts, fit, total_steps
from launcher.metrics import TrainMeter
from launcher.precision import Precision
from launcher.recipe import Loaded, instantiate
from launcher.recipe.flat import differences, hparams
from launcher.stopping import StopFlag, Stopped, requeue


def _place(loaded: Loaded):
    chosen = scheduler.select_gpus(loaded.recipe.devices, os.environ, _nvidia_smi)
    if chosen is not None:  # before anything starts CUDA, which reads it once
        os.environ["CUDA_VISIBLE_DEVICES"] = chosen
    visible = torch.cuda.device_count() if loaded.recipe.devices != "cpu" else 0
    placement, notes = scheduler.place(os.environ, loaded.recipe.devices, visible)
    return placement, notes, visible


def run(loaded: Loaded, overrides: list) -> int:
    """The command line's run: `strategy=ddp` in a plain process starts torchrun (its exit code);
    anything else trains here (0)."""
    placed = _place(loaded)
    placement, _, visible = placed
    if strategies.must_spawn(loaded.recipe.strategy, placement):
        nproc = spawn.process_count(loaded.recipe.nproc_per_node, visible, placement.device, _cpus())
        return spawn.torchrun(loaded.path, overrides, nproc)
    train(loaded, placed)
    return 0


def train(loaded: Loaded, placed: Optional[tuple] = None) -> Dict[str, float]:
    placement, notes, _ = placed or _place(loaded)
    strategy = strategies.create(loaded.recipe.strategy, placement)
    strategy.setup()
    try:
        with strategy.mistakes_shared():
            recipe = loaded.recipe
            recipe.precision, recipe.trainer.grad_accum_steps, settled = strategy.settle(
                recipe.precision, recipe.trainer.grad_accum_steps)
            loaded.config.precision, loaded.config.trainer.grad_accum_steps = recipe.precision, recipe.trainer.grad_accum_steps
            try:
                return _train(loaded, strategy, notes + settled + strategy.notes())
            except SystemExit as e:  # sys.exit() in a component's code (a forward, a dataset's item, a metric)
                raise UserError(f"{_innermost(e)} raised SystemExit({e.code!r}) during training; a component must "
                                f"not exit the process (raise an exception instead)", every_rank=True) from None
    finally:
        strategy.teardown()


def _train(loaded: Loaded, strategy: strategies.Strategy, notes: list) -> Dict[str, float]:
    recipe, placement, device = loaded.recipe, strategy.placement, strategy.device
    run_dir = Path(recipe.run_dir)
    # Rank 0 alone writes, and may meet a mistake (an unwritable folder, a full disk) the others do not
    # see: each such step is agreed on, so that every rank stops with it rather than wait in a collective.
    strategy.agree(lambda: _write_recipe(run_dir, loaded.config) if placement.is_main else None)
    logger, console = strategy.agree(lambda: loggers.make(placement.is_main, run_dir, recipe.logging.tensorboard,
                                                          recipe.logging.progress_bar))
    for note in notes:
        console.info(note)
    rows = strategy.all_gather_object(_describe(placement))  # a collective: every rank takes part
    console.info(scheduler.table(rows))
    checkpointer = Checkpointer(run_dir, recipe.checkpoint.keep, writer=placement.is_main)
    found = strategy.agree(lambda: checkpointer.resume_from(recipe.checkpoint.resume) if placement.is_main else None)
    resume = strategy.all_gather_object(found)[0]  # rank 0 decides, so every rank resumes from the same step

    seeding.seed_everything(recipe.seed)
    model = _build(recipe.model, "model", nn.Module).to(device)
    state = None
    if resume is not None:
        checkpoint.load_model_state(model, resume / "model.pt", map_location=device)
        state = checkpoint.load_file(resume / "state.pt", map_location=device)
    elif recipe.checkpoint.init_from:
        checkpoint.load_model_state(model, Path(recipe.checkpoint.init_from), map_location=device)
        console.info(f"initialised the model from {recipe.checkpoint.init_from}")
    wrapped = strategy.wrap(model)
    optimizer = _build(recipe.optimizer, "optimizer", object, [q for q in model.parameters() if q.requires_grad])
    schedule = _build(recipe.lr_schedule, "lr_schedule", object, optimizer) if recipe.lr_schedule else None
    precision = Precision(recipe.precision, device)
    metrics = {name: _build(spec, f"metrics.{name}") for name, spec in recipe.metrics.items()}
    cfg = recipe.data
    train_data = data.TrainData(_build(cfg.train, "data.train"), cfg.batch_size, recipe.trainer.grad_accum_steps,
                                placement.world_size, placement.rank, cfg.shuffle, recipe.seed, cfg.num_workers, device)
    val = data.val_batches(_build(cfg.val, "data.val") if cfg.val else None, cfg.batch_size,
                           placement.world_size, placement.rank, cfg.num_workers, device, recipe.seed)

    position = data.Position()
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        if schedule is not None:
            schedule.load_state_dict(state["lr_schedule"])
        precision.load_state_dict(state["scaler"])
        position = data.Position(**state["position"])
        rngs = state["rng"]
        seeding.restore(rngs[placement.rank] if placement.rank < len(rngs) else rngs[0], device)
        console.info(f"resumed from {resume} (step {position.step}, epoch {position.epoch})")
        changed = differences(OmegaConf.create(state["recipe"]), loaded.config)
        if changed:
            console.info(f"the recipe differs from the checkpoint's in {', '.join(changed)}; the optimizer and "
                         f"LR schedule continue from their saved state (checkpoint.resume=never starts over)")

    def save(pos: data.Position, final: bool) -> None:
        rngs = strategy.all_gather_object(seeding.capture(device))  # a collective: every rank calls save
        model_state = checkpoint.to_cpu(strategy.unwrap(wrapped).state_dict())
        state = {"position": vars(pos).copy(), "optimizer": optimizer.state_dict(),
                 "lr_schedule": schedule.state_dict() if schedule is not None else None,
                 "scaler": precision.state_dict(), "rng": rngs, "world_size": placement.world_size,
                 "recipe": OmegaConf.to_yaml(loaded.config)}

        def write() -> None:
            checkpointer.save(pos.step, model_state, state)
            if final:
                checkpointer.save_final(model_state)

        strategy.agree(write)  # no rank goes on before the checkpoint is complete, or all stop with its mistake
        # Kept after the agreement (a gather): without it, about one run in twelve under torchrun (gloo,
        # torch 2.13) aborted at exit after its last save ("terminate called without an active
        # exception"; 4 of 51 runs, 0 of 40 with it).
        strategy.barrier()

    samples_per_step = cfg.batch_size * recipe.trainer.grad_accum_steps
    peak = throughput.peak_flops(device, recipe.logging.peak_tflops)
    rates = throughput.Throughput(samples_per_step, cfg.tokens_per_sample,
                                  throughput.model_flops_per_sample(model, cfg.tokens_per_sample),
                                  peak * placement.world_size if peak else None, device)
    meter = TrainMeter(metrics, device, rates)
    logger.text("recipe", "    " + OmegaConf.to_yaml(loaded.config).replace("\n", "\n    "))
    logger.hparams(hparams(loaded.config), ["train/loss", "val/loss"] + [f"val/{m}" for m in metrics])
    loss_fn = _build(recipe.loss, "loss")
    data.check_first_batch(train_data.loader.dataset, cfg.batch_size // placement.world_size, model, loss_fn,
                           metrics, precision.autocast, device)
    if recipe.trainer.compile:  # after the eager check. The wrapper is compiled, so DDP's buckets still
        wrapped = torch.compile(wrapped)  # overlap backward; checkpoints hold the plain model's keys
    parts = Parts(wrapped, optimizer, schedule, loss_fn=loss_fn, metrics=metrics,
                  precision=precision, strategy=strategy, data=train_data, val=val, meter=meter,
                  logger=logger, console=console, save=save, stop=StopFlag(placement.world_size),
                  save_on_stop=recipe.checkpoint.on_signal)
    total = total_steps(recipe.trainer, train_data.steps_per_epoch)
    if position.step >= total:
        console.info(f"{run_dir} already finished at step {position.step}; nothing to train")
        save(position, final=True)
        results: Dict[str, float] = {}
    else:
        console.info(f"training {recipe.name}: {total} steps of {samples_per_step} samples, "
                     f"{train_data.steps_per_epoch} steps per epoch, on {device} ({strategy.name})")
        parts.stop.install()
        try:
            results = fit(parts, recipe.trainer, recipe.checkpoint.every, position)
        except Stopped as stopped:
            logger.close()
            saved = f"saved {run_dir / 'checkpoints' / f'step_{stopped.step}'}" if recipe.checkpoint.on_signal else "not saved"
            console.info(f"{stopped}: {saved}")
            if placement.is_main and recipe.checkpoint.on_signal:
                said = requeue()  # raises RequeueFailed when Slurm refuses
                if said:
                    console.info(said)
            raise
        finally:
            parts.stop.restore()
    logger.close()
    final = " | ".join(f"{k} {v:.4f}" for k, v in results.items() if k.startswith("val/") or k == "train/loss")
    console.info(f"done: step {position.step} | {final} | model: {run_dir / 'model.pt'}")
    return results


def _cpus() -> int:
    """The CPU cores this process may run on (its affinity, which a container or taskset narrows)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _write_recipe(run_dir: Path, config) -> None:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "recipe.yaml").write_text(OmegaConf.to_yaml(config))
    except OSError as e:
        raise UserError(f"run_dir: cannot write {run_dir}: {e.strerror or e}; point run_dir=... at a "
                        f"writable folder") from None


def _innermost(e: BaseException) -> str:
    """Where an exception was raised, as file:line in function (the component's code, not ours)."""
    import traceback

    frames = traceback.extract_tb(e.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else "a component"


def _nvidia_smi() -> list:
    """The GPUs this process may use as (id, free MiB), from nvidia-smi: no CUDA context is created."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return []
    out = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid,memory.free", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30).stdout
    rows = [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.count(",") == 2]
    allowed = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return [(index, int(free)) for index, uuid, free in rows if not allowed or index in allowed or uuid in allowed]


def _describe(placement: scheduler.Placement) -> Dict[str, Any]:
    row = {"rank": placement.rank, "local rank": placement.local_rank, "node": placement.node_rank,
           "device": placement.device, "physical GPU": "-"}
    if placement.device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(placement.device))
        row["physical GPU"] = f"{placement.gpu} {props.name} {getattr(props, 'uuid', '')}".strip()
    return row


def _build(spec: Dict[str, Any], key: str, kind: type = object, *args: Any) -> Any:
    """Build a recipe component. A constructor that rejects the recipe's arguments (a negative size, a
    value out of its range) is the recipe's mistake: one line naming the key, not a traceback."""
    try:
        built = instantiate(spec, *args)
    except (TypeError, ValueError, RuntimeError) as e:
        raise UserError(f"{key}: {spec['_target_']} failed with the recipe's arguments: "
                        f"{type(e).__name__}: {first_line(e)}") from None
    except SystemExit as e:  # sys.exit() in a constructor would end the run with its code and no model
        raise UserError(f"{key}: {spec['_target_']} raised SystemExit({e.code!r}) while being built; a component "
                        f"must not exit the process (raise an exception instead)") from None
    if kind is nn.Module and not isinstance(built, nn.Module):
        raise UserError(f"{key}: {spec['_target_']} built a {type(built).__name__}, not a torch.nn.Module")
    if key.startswith("data.") and not (hasattr(built, "__getitem__") and hasattr(built, "__len__")):
        raise UserError(f"{key}: {spec['_target_']} built a {type(built).__name__}, not a map-style Dataset "
                        f"(__getitem__ and __len__)")
    return built
