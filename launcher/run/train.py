"""One run, end to end: place, build every part from its section of the recipe, resume, train, save."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, Optional

import torch
from omegaconf import OmegaConf

from launcher import collector, loggers, report, strategies
from launcher.run import assemble
from launcher.run import build
from launcher.data import sampling as data
from launcher.run import first_batch
from launcher.run import planning
from launcher.run import reference
from launcher.observe import holdings
from launcher.placement import gpus, scheduler
from launcher.placement import spawn
from launcher.observe import hang
from launcher.observe import throughput
from launcher.observe import watch
from launcher.checkpoint import Checkpoints, RunState
from launcher.errors import CheckpointsFailed, Hung, NoQuorum, OutOfMemory, TrainingDiverged, UserError
from launcher.run.loop import Parts, fit, total_steps
from launcher.run.metrics import TrainMeter
from launcher.model import moe
from launcher.model.precision import Precision, float8_scales_ahead, tf32
from launcher.recipe import Loaded
from launcher.recipe.flat import hparams
from launcher.run_dir import RunFolder
from launcher.stopping import StopFlag, Stopped, requeue


def _place(loaded: Loaded):
    chosen = scheduler.select_gpus(loaded.recipe.devices, os.environ, gpus.nvidia_smi)
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
        nproc = spawn.process_count(loaded.recipe.nproc_per_node, visible, placement.device, spawn.cpus(),
                                    loaded.recipe.strategy, loaded.recipe.parallel.laid_out())
        collector.resume()  # this process now waits on the workers, for as long as they train
        return spawn.torchrun(loaded.path, overrides, nproc)
    if loaded.recipe.nproc_per_node is not None and placement.launched_by == "plain":
        placed[1].append(f"nproc_per_node: {loaded.recipe.nproc_per_node} starts processes for strategy ddp or fsdp; "
                         f"strategy {loaded.recipe.strategy} runs this one process")
    train(loaded, placed)
    return 0


def train(loaded: Loaded, placed: Optional[tuple] = None) -> Dict[str, float]:
    placement, notes, _ = placed or _place(loaded)
    strategy = strategies.create(loaded.recipe.strategy, placement, loaded.recipe.ddp, loaded.recipe.fsdp,
                                 loaded.recipe.dist_timeout, loaded.recipe.run_dir, loaded.recipe.parallel,
                                 loaded.recipe.fault_tolerance, loaded.config)
    strategy.setup()
    _own_checkpoints(loaded, strategy)
    folder = RunFolder(Path(loaded.recipe.run_dir), loaded.recipe.checkpoint.dir)
    try:
        with strategy.mistakes_shared():
            recipe = loaded.recipe
            recipe.precision, recipe.trainer.grad_accum_steps, settled = strategy.settle(
                recipe.precision, recipe.trainer.grad_accum_steps)
            loaded.config.precision, loaded.config.trainer.grad_accum_steps = recipe.precision, recipe.trainer.grad_accum_steps
            try:
                return _train(loaded, strategy, folder, loaded.notes + notes + settled + strategy.notes())
            except SystemExit as e:  # sys.exit() in a component's code (a forward, a dataset's item, a metric)
                raise UserError(f"{report.where_raised(e)} raised SystemExit({e.code!r}) during training; a component must "
                                f"not exit the process (raise an exception instead)", every_rank=True) from None
    finally:
        folder.close()
        strategy.teardown()


def _own_checkpoints(loaded: Loaded, strategy: strategies.Strategy) -> None:
    """A replica group's checkpoints in a place of its own below checkpoint.dir (fault tolerance's groups share a
    recipe), in the recipe.yaml it writes too (python -m launcher.export finds them there)."""
    configured = loaded.recipe.checkpoint.dir
    if loaded.recipe.fault_tolerance is None or not configured:
        return
    from launcher.ft.settings import checkpoints_of

    own = checkpoints_of(configured, strategy.group, loaded.recipe.run_dir)
    if own != configured:
        loaded.recipe.checkpoint.dir = loaded.config.checkpoint.dir = own
        loaded.notes.append(f"checkpoint.dir: group {strategy.group} keeps its checkpoints in {own}, a place of its own "
                            f"(each replica group's below {configured})")


def _train(loaded: Loaded, strategy: strategies.Strategy, folder: RunFolder, notes: list) -> Dict[str, float]:
    resume, init_from, logger, console = _open(loaded, strategy, folder, notes)
    position = parts = None
    try:
        checkpoints, parts = _build(loaded, strategy, folder.path, logger, console, init_from, resume)
        position = checkpoints.run.position
        if resume is not None:
            for line in checkpoints.resume(resume, loaded.config):
                console.info(line)
            said = build.implementation_resumed(parts.optimizer)
            if said:
                console.info(said)
        strategy.agree(lambda: logger.start(_tracked(loaded, strategy, folder.path, checkpoints, parts)))
        return _fit(loaded, checkpoints, parts, folder.path)
    except RuntimeError as e:  # a collective that waited dist_timeout for a rank that stopped or died
        if not hang.timed_out(e):
            raise
        raise hang.report(e, position.step + 1 if position else None, loaded.recipe.dist_timeout,
                          strategy.flight_recorder()) from None
    finally:
        if parts is not None:  # the loaders' workers end now, not when the garbage collector finds them
            for batches in (parts.data, parts.val):
                if batches is not None:
                    batches.close()
        logger.close("failed")  # unless closed already, as finished or stopped


def _tracked(loaded: Loaded, strategy: strategies.Strategy, run_dir: Path, checkpoints: Checkpoints, parts: Parts):
    """What the loggers record of this run: the recipe as resolved, and what actually runs."""
    recipe = loaded.recipe
    effective = {"strategy": strategy.name, "world_size": strategy.placement.world_size,
                 "device": strategy.device.type, "precision": recipe.precision,
                 "grad_accum_steps": recipe.trainer.grad_accum_steps,
                 "batch_size_per_rank": recipe.data.batch_size // strategy.data_share()[0],
                 "total_steps": total_steps(recipe.trainer, parts.data.steps_per_epoch)}  # a sweep's report reads it
    config = {**OmegaConf.to_container(loaded.config, resolve=True), "effective": effective}
    flat = {**hparams(loaded.config), **{f"effective.{k}": v for k, v in effective.items()}}
    summary = ["train/loss", "val/loss"] + [f"val/{m}" for m in parts.metrics]
    return loggers.Start(run_dir, recipe.name, checkpoints.run.position.step, OmegaConf.to_yaml(loaded.config),
                         config, flat, summary, say=parts.console.info)


def _open(loaded: Loaded, strategy: strategies.Strategy, folder: RunFolder, notes: list):
    """The run folder, the loggers and the console; which checkpoint the run continues, if any."""
    recipe, placement = loaded.recipe, strategy.placement
    # Rank 0 locks the folder, settles which checkpoint the run continues (moving another history
    # aside) and writes the recipe, before TensorBoard opens its folder; every rank resumes from it.
    # Rank 0 alone writes, and may meet a mistake (an unwritable folder, a full disk) the others do not
    # see: each such step is agreed on, so that every rank stops with it rather than wait in a collective.
    opened = strategy.agree(lambda: folder.open(OmegaConf.to_yaml(loaded.config), recipe.checkpoint.resume,
                                                recipe.checkpoint.init_from) if placement.is_main else None)
    resume, said, init_from = strategy.all_gather_object(opened)[0]
    logger, console = strategy.agree(lambda: loggers.make(placement.is_main, folder.path, recipe.logging))
    for note in notes + said:
        console.info(note)
    rows = strategy.all_gather_object(gpus.row(placement))  # a collective: every rank takes part
    console.info(scheduler.table(rows))
    return resume, init_from, logger, console


def _build(loaded: Loaded, strategy: strategies.Strategy, run_dir: Path, logger, console, init_from, resume=None):
    """Every part of the run from its section of the recipe, the model wrapped by the strategy."""
    recipe, placement, device = loaded.recipe, strategy.placement, strategy.device
    model = assemble.built(recipe, strategy, run_dir, console, init_from)
    loads, said = moe.watched(model, device, recipe.parallel.pp)  # an MoE model's tokens per expert, as it trains
    if said:
        console.info(said)
    cfg = recipe.data
    train_data, val, notes = build.data_for(cfg, recipe.trainer.grad_accum_steps, strategy.data_share(), recipe.seed,
                                             device, placement.world_size, model, strategy.val_share())
    for note in notes:
        console.info(note)
    precision = Precision(recipe.precision, device)
    tf32(recipe.tf32, device)
    step = build.step(recipe.step, recipe.loss)
    given = {name: build.component(spec, f"metrics.{name}") for name, spec in recipe.metrics.items()}
    metrics = {**getattr(step, "metrics", {}), **given}  # a step's own (the DPO step's rewards), then the recipe's
    if train_data.is_stream and recipe.trainer.max_epochs:
        raise UserError(f"trainer.max_epochs: data.train is a stream ({type(train_data.share.dataset).__name__}, an "
                        f"IterableDataset) whose epochs are not counted ahead; set trainer.max_steps and "
                        f"trainer.max_epochs=null")
    flops = throughput.model_flops_per_sample(model, cfg.tokens_per_sample)  # the whole model's, before a pipeline cuts it
    per_rank = cfg.batch_size // strategy.data_share()[0]

    def checked(m: torch.nn.Module) -> list:  # the model as training starts: the reference, where the step has one
        reference.attach(step, reference.datasets_of(train_data, val), m, strategy, run_dir, per_rank,
                         train_data.collate, precision.autocast, console.info, reference.kept_beside(resume))
        return first_batch.check(train_data.first_items, train_data.collate, m, step, given, precision.autocast,
                                 device)  # the recipe's metrics: a step's own are its to check
    wrapped = assemble.wrapped(model, strategy, console, init_from, checked)
    trained = strategy.unwrap(wrapped)  # the model (a pipeline: this rank's stages)
    if recipe.precision == "fp8" and strategy.sharded:
        precision.after_step = float8_scales_ahead(trained)
    optimizer, chosen = build.optimizer(recipe.optimizer, [q for q in trained.parameters() if q.requires_grad])
    if chosen:
        console.info(chosen)
    schedule = build.component(recipe.lr_schedule, "lr_schedule", optimizer) if recipe.lr_schedule else None
    run = RunState(data.Position(), schedule, precision, strategy, OmegaConf.to_yaml(loaded.config), train_data)
    checkpoints = Checkpoints(strategy, wrapped, optimizer, run, run_dir, recipe.checkpoint, console.info)
    samples_per_step = cfg.batch_size * recipe.trainer.grad_accum_steps
    peak = throughput.peak_flops(device, recipe.logging.peak_tflops)
    groups = recipe.fault_tolerance.groups if recipe.fault_tolerance is not None else 1
    rates = throughput.Throughput(samples_per_step, cfg.tokens_per_sample, flops,
                                  peak * placement.world_size if peak else None, device, groups)
    if recipe.trainer.compile:  # after the eager check. The wrapper is compiled, so DDP's buckets still
        wrapped = torch.compile(wrapped)  # overlap backward; checkpoints hold the plain model's keys
    parts = Parts(wrapped, optimizer, schedule, step=step, metrics=metrics,
                  precision=precision, strategy=strategy, data=train_data, val=val,
                  meter=TrainMeter(metrics, device, rates, loads), logger=logger, console=console,
                  save=lambda pos, final, wait: checkpoints.save(final, wait), stop=StopFlag(placement.world_size),
                  save_on_stop=recipe.checkpoint.on_signal, idle=lambda: checkpoints.finish_pending(wait=False),
                  watch=watch.make(recipe, placement.rank, placement.world_size, device, run_dir, console.info))
    planning.measure(recipe, parts, model)
    return checkpoints, parts


def _fit(loaded: Loaded, checkpoints: Checkpoints, parts: Parts, run_dir: Path) -> Dict[str, float]:
    """Train to the end (or to a signal), then close the loggers and say where the model is."""
    recipe, strategy, console, logger = loaded.recipe, checkpoints.strategy, parts.console, parts.logger
    position = checkpoints.run.position
    total = total_steps(recipe.trainer, parts.data.steps_per_epoch)
    if position.step >= total:
        console.info(f"{run_dir} already finished at step {position.step}; nothing to train (name=NEW trains a "
                     f"run of its own, checkpoint.resume=never trains this one anew)")
        checkpoints.save(final=True)
        results: Dict[str, float] = {}
    else:
        samples = recipe.data.batch_size * recipe.trainer.grad_accum_steps
        per_epoch = f"{parts.data.steps_per_epoch} steps per epoch" if parts.data.steps_per_epoch else "from a stream"
        console.info(f"training {recipe.name}: {total} steps of {samples} samples, {per_epoch}, "
                     f"on {strategy.device} ({strategy.name})")
        if checkpoints.saved_step is not None:  # continued, and training on: the old model.pt is not this run's end
            said = strategy.agree(lambda: RunFolder(run_dir).set_aside_model(position.step) if strategy.placement.is_main else None)
            if said:
                console.info(said)
        parts.stop.install()
        started = position.step
        planned = planning.planned(loaded, parts)
        collector.resume()  # paused while the process started (python -m launcher)
        try:
            try:
                results = fit(parts, recipe.trainer, recipe.checkpoint.every, position)
            except Stopped as stopped:
                checkpoints.finish_pending()  # a checkpoint still being written is completed before the exit
                logger.close("stopped")
                saved = (f"saved {checkpoints.folder / f'step_{stopped.step}'}" if checkpoints.saved_step == stopped.step
                         else "not saved")
                console.info(f"{stopped}: {saved}")
                if strategy.placement.is_main and recipe.checkpoint.on_signal:
                    said = requeue()  # raises RequeueFailed when Slurm refuses
                    if said:
                        console.info(said)
                raise
            except RuntimeError as e:  # a wrapper's own error that a recipe key fixes (DDP's unused parameters)
                if watch.is_out_of_memory(e):
                    raise OutOfMemory(parts.watch.out_of_memory(position.step + 1, strategy.device,
                                                                strategy.placement.rank)) from None
                explained = strategy.explain(e)
                if explained is None:
                    raise
                raise UserError(explained) from None
            finally:
                parts.stop.restore()
                parts.watch.close(position.step)
        except NoQuorum:  # fault tolerance: at a step boundary, on every rank of the group; its state is whole
            _save_before_failing(checkpoints, parts, started, run_dir, console, whole=True)
            raise
        except (Stopped, TrainingDiverged, OutOfMemory, Hung, CheckpointsFailed):
            raise  # nothing is saved after a NaN, out of memory, a lost rank or saves failing; a signal saved already
        except Exception:  # a mistake met mid-run, a full disk, a bug in a component
            _save_before_failing(checkpoints, parts, started, run_dir, console)
            raise
        finally:
            if planned is not None:
                planned.close()
    logger.close("finished")
    if strategy.placement.world_size > 1:  # what sharding and splitting saved each rank
        console.info(holdings.line(strategy.placement.rank, holdings.held(parts.model, parts.optimizer)))
    final = " | ".join(f"{k} {v:.4f}" for k, v in results.items() if k.startswith("val/") or k == "train/loss")
    model = f"model: {run_dir / 'model.pt'}" if recipe.checkpoint.consolidate != "never" or not strategy.sharded else \
        "model: not gathered (checkpoint.consolidate=never; python -m launcher.export makes one from a checkpoint)"
    exported = f"HF folder: {run_dir / 'hf'}" if recipe.checkpoint.export_hf else ""
    console.info(" | ".join(x for x in (f"done: step {position.step}", final, model, exported) if x))
    return results


def _save_before_failing(checkpoints: Checkpoints, parts: Parts, started: int, run_dir: Path, console,
                         whole: bool = False) -> None:
    """Before an error ends the run after its first step: a checkpoint of the last whole step, where one
    process trains or where every rank met the error at the same step boundary (`whole`; elsewhere several
    cannot agree on one once a rank has failed: there, the newest checkpoint), and a line saying which step
    the same command resumes from. The error stays the last line."""
    step = checkpoints.run.position.step
    if (step > started and parts.between_steps and checkpoints.saved_step != step
            and (whole or checkpoints.strategy.placement.world_size == 1)):
        try:
            checkpoints.save(final=False)
        except Exception:  # noqa: BLE001 - the disk may be what failed: the error that stops the run says so
            pass
    if checkpoints.saved_step:
        console.info(f"the newest checkpoint is {checkpoints.folder / f'step_{checkpoints.saved_step}'}: the same "
                     f"command resumes from step {checkpoints.saved_step}")
    elif step > started:
        console.info("no checkpoint was saved: the same command starts over")
