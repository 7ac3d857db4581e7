"""One run, end to end: place, build every part from its section of the recipe, resume, train, save."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, Optional

import torch
from omegaconf import OmegaConf

from launcher import build, checkpoint, data, first_batch, loggers, scheduler, seeding, spawn, strategies, throughput
from launcher.checkpoint import Checkpointer
from launcher.errors import UserError, first_line
from launcher.loop import Parts, fit, total_steps
from launcher.metrics import TrainMeter
from launcher.precision import Precision
from launcher.recipe import Loaded
from launcher.recipe.flat import differences, hparams
from launcher.run_dir import RunFolder
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
    strategy = strategies.create(loaded.recipe.strategy, placement, loaded.recipe.ddp)
    strategy.setup()
    folder = RunFolder(Path(loaded.recipe.run_dir))
    try:
        with strategy.mistakes_shared():
            recipe = loaded.recipe
            recipe.precision, recipe.trainer.grad_accum_steps, settled = strategy.settle(
                recipe.precision, recipe.trainer.grad_accum_steps)
            loaded.config.precision, loaded.config.trainer.grad_accum_steps = recipe.precision, recipe.trainer.grad_accum_steps
            try:
                return _train(loaded, strategy, folder, notes + settled + strategy.notes())
            except SystemExit as e:  # sys.exit() in a component's code (a forward, a dataset's item, a metric)
                raise UserError(f"{_innermost(e)} raised SystemExit({e.code!r}) during training; a component must "
                                f"not exit the process (raise an exception instead)", every_rank=True) from None
    finally:
        folder.close()
        strategy.teardown()


def _train(loaded: Loaded, strategy: strategies.Strategy, folder: RunFolder, notes: list) -> Dict[str, float]:
    recipe, placement, device = loaded.recipe, strategy.placement, strategy.device
    run_dir = folder.path
    # Rank 0 locks the folder, settles which checkpoint the run continues (moving another history
    # aside) and writes the recipe, before TensorBoard opens its folder; every rank resumes from it.
    # Rank 0 alone writes, and may meet a mistake (an unwritable folder, a full disk) the others do not
    # see: each such step is agreed on, so that every rank stops with it rather than wait in a collective.
    opened = strategy.agree(lambda: folder.open(OmegaConf.to_yaml(loaded.config), recipe.checkpoint.resume,
                                                recipe.checkpoint.init_from) if placement.is_main else None)
    resume, said, init_from = strategy.all_gather_object(opened)[0]
    logger, console = strategy.agree(lambda: loggers.make(placement.is_main, run_dir, recipe.logging.tensorboard,
                                                          recipe.logging.progress_bar))
    for note in notes + said:
        console.info(note)
    rows = strategy.all_gather_object(_describe(placement))  # a collective: every rank takes part
    console.info(scheduler.table(rows))
    checkpointer = Checkpointer(run_dir, recipe.checkpoint.keep, writer=placement.is_main)

    seeding.seed_everything(recipe.seed)
    model = build.component(recipe.model, "model").to(device)
    state = old_recipe = None
    if resume is not None:  # its CRC-32s were checked when rank 0 chose it
        checkpoint.load_model_state(model, resume / "model.pt", map_location=device, verified=True)
        state = checkpoint.load_state(resume / "state.pt", map_location=device)
        old_recipe = checkpoint.saved_recipe(state)
        _refuse_changed_parts(old_recipe, loaded.config, resume)
    elif init_from:
        where = checkpoint.load_model_state(model, Path(init_from), map_location=device)
        console.info(f"initialised the model from {init_from}" + (f" ({where})" if where else ""))
    wrapped = strategy.wrap(model)
    optimizer = build.component(recipe.optimizer, "optimizer", [q for q in model.parameters() if q.requires_grad])
    schedule = build.component(recipe.lr_schedule, "lr_schedule", optimizer) if recipe.lr_schedule else None
    precision = Precision(recipe.precision, device)
    metrics = {name: build.component(spec, f"metrics.{name}") for name, spec in recipe.metrics.items()}
    cfg = recipe.data
    train_data, val = build.data_for(cfg, recipe.trainer.grad_accum_steps, placement, recipe.seed, device)

    position = data.Position()
    if state is not None:
        position = _restore(state, resume, optimizer, schedule, precision, placement.rank, device)
        console.info(f"resumed from {resume} (step {position.step}, epoch {position.epoch})")
        changed = differences(old_recipe, loaded.config)
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
    step = build.step(recipe.step, recipe.loss)
    for note in first_batch.check(train_data.loader.dataset, cfg.batch_size // placement.world_size,
                                  train_data.collate, model, step, metrics, precision.autocast, device):
        console.info(note)
    if recipe.trainer.compile:  # after the eager check. The wrapper is compiled, so DDP's buckets still
        wrapped = torch.compile(wrapped)  # overlap backward; checkpoints hold the plain model's keys
    parts = Parts(wrapped, optimizer, schedule, step=step, metrics=metrics,
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
        except RuntimeError as e:  # a wrapper's own error that a recipe key fixes (DDP's unused parameters)
            explained = strategy.explain(e)
            if explained is None:
                raise
            raise UserError(explained) from None
        finally:
            parts.stop.restore()
    logger.close()
    final = " | ".join(f"{k} {v:.4f}" for k, v in results.items() if k.startswith("val/") or k == "train/loss")
    console.info(" | ".join(x for x in (f"done: step {position.step}", final, f"model: {run_dir / 'model.pt'}") if x))
    return results


def _restore(state: Dict[str, Any], resume: Path, optimizer, schedule, precision: Precision, rank: int,
             device: torch.device) -> data.Position:
    """Put the saved run state back; a state that does not fit this run is one line, not a traceback."""
    try:
        optimizer.load_state_dict(state["optimizer"])
        if schedule is not None:
            schedule.load_state_dict(state["lr_schedule"])
        precision.load_state_dict(state["scaler"])
        rngs = state["rng"]
        seeding.restore(rngs[rank] if rank < len(rngs) else rngs[0], device)
    except (KeyError, TypeError, ValueError, RuntimeError, IndexError, AttributeError) as e:
        raise UserError(f"checkpoint.resume: {resume / 'state.pt'} does not fit this run ({type(e).__name__}: "
                        f"{first_line(e)[:160]}); start over with checkpoint.resume=never") from None
    return data.Position(**state["position"])


def _refuse_changed_parts(saved: Dict[str, Any], current, resume: Path) -> None:
    """The saved optimizer and schedule states belong to the classes that wrote them: another
    optimizer, or a schedule added or removed, cannot continue them."""
    changed = []
    for key in ("optimizer", "lr_schedule"):
        old, new = saved.get(key), current[key]
        old = old.get("_target_") if isinstance(old, dict) else old
        new = new["_target_"] if new is not None else None
        if old != new:
            changed.append(f"{key} ({old or 'none'} -> {new or 'none'})")
    if changed:
        raise UserError(f"checkpoint.resume: the recipe changed {' and '.join(changed)} since {resume}, whose saved "
                        f"state cannot continue under it; start over with checkpoint.resume=never (add "
                        f"checkpoint.init_from={resume / 'model.pt'} to keep its weights)")


def _cpus() -> int:
    """The CPU cores this process may run on (its affinity, which a container or taskset narrows)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


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
