"""The sharded format: every rank writes its own shards with torch.distributed.checkpoint (DCP).

    checkpoints/step_<N>/.metadata          DCP's index of every tensor's shards (rank 0)
    checkpoints/step_<N>/__<rank>_0.distcp   each rank's shards: model, optimizer, and rank 0's run state
    checkpoints/step_<N>/model.pt            the gathered model too, where checkpoint.consolidate asks

In an object store (checkpoint.dir=s3://...) DCP writes and reads through s3torchconnector's DCP storage
(s3_connector.py), or fsspec's (FsspecWriter, FsspecReader: other URLs, or s3:// without s3torchconnector),
and the manifest rank 0 writes last seals the step, as for the full format.

The state saved is {"model": ..., "optimizer": ..., "run": RunState}, keyed by the plain model's
parameter names, so DCP reshards it on load: any world size, any strategy, reads it. DCP is imported
here only when a sharded checkpoint is written or read (dcp_safe.py reads its files)."""

from __future__ import annotations

import contextlib
import time
import warnings
from pathlib import Path
from typing import Any, Dict, Iterator, Optional

import torch
import torch.distributed as dist

from launcher.checkpoint import adapters, dcp_io, files, layout, manifest, run_state, s3_connector, storage
from launcher.errors import UserError, shown

NAME = "sharded"
METADATA = ".metadata"


def holds(folder: Path) -> bool:
    return (folder / METADATA).is_file()


def save(checkpoints, step: int, final: bool, background: bool = False) -> None:
    """Every rank writes its shards (in the background with async_save, but for the final save); rank 0
    seals the checkpoint once every rank's are written."""
    strategy, folder, writer = checkpoints.strategy, checkpoints.folder, checkpoints.writer
    agree = strategy.agree
    partial = layout.partial(folder, step)
    agree(lambda: layout.prepare(folder, step) if writer else None)
    model_state, optimizer_state = strategy.state_dicts(checkpoints.model, checkpoints.optimizer)
    state = {"model": model_state, "optimizer": optimizer_state, "run": checkpoints.run}
    if background:  # the state is copied to host memory before start() returns
        group = strategy.checkpoint_group()
        stager = _stager(checkpoints)
        future = agree(lambda: _guarded(folder, step, lambda: start(partial, state, group, stager)))
    else:
        agree(lambda: _guarded(folder, step, lambda: write(partial, state)))
    # model.pt of this step's weights, gathered now (a collective), before training changes them
    whole = checkpoints.consolidate == "every" or (final and checkpoints.consolidate == "final")
    full = strategy.model_state(checkpoints.model) if whole else None
    gathered = agree(lambda: _guarded(folder, step, lambda: {"model.pt": files.save(partial / "model.pt", full)})
                     if writer and full is not None else {})
    if background:
        checkpoints.pending = _Pending(checkpoints, step, future, gathered)
        return
    _seal(checkpoints, step, gathered, full if final else None, last=final)


def _guarded(folder: Path, step: int, write_: Any) -> Any:
    with layout.guarding(folder, step):
        return write_()


def _seal(checkpoints, step: int, gathered: Dict[str, Any], final: Optional[Dict[str, torch.Tensor]],
          last: bool = False) -> None:
    """Once every rank's shards are written: rank 0's manifest (every rank's files) and rename, then the
    final model.pt when given; at the last save without one, checkpoint.export_hf's folder from the shards."""
    strategy, folder = checkpoints.strategy, checkpoints.folder
    partial, rank = layout.partial(folder, step), strategy.placement.rank
    mine = strategy.agree(lambda: _guarded(folder, step, lambda: own_files(partial, rank)))
    listed: Dict[str, Any] = dict(gathered)
    for theirs in strategy.all_gather_object(mine):
        listed.update(theirs)

    def seal() -> None:
        with layout.guarding(folder, step):
            layout.seal(folder, step, listed, checkpoints.keep, sharded=True, world_size=strategy.placement.world_size)
        if final is not None:
            checkpoints.write_model(final)
        elif last and checkpoints.export_hf:  # not gathered: rank 0 reads the shards an output shard at a time
            checkpoints.export_hf_folder(lazy_weights(folder / f"step_{step}"))

    strategy.agree(lambda: seal() if checkpoints.writer else None)


class _Pending:
    """A save whose shards are being written in the background."""

    def __init__(self, checkpoints, step: int, future: Any, gathered: Dict[str, Any]):
        self.checkpoints, self.step, self.future, self.gathered = checkpoints, step, future, gathered
        self.began = time.perf_counter()

    def ready(self) -> bool:
        """Written on every rank (a collective)."""
        return all(self.checkpoints.strategy.all_gather_object(self.future.done()))

    def seal(self) -> None:
        folder = self.checkpoints.folder
        self.checkpoints.strategy.agree(lambda: _guarded(folder, self.step, self.future.result))
        _seal(self.checkpoints, self.step, self.gathered, None)


def write(folder: Path, state: Dict[str, Any], group: Optional[Any] = None) -> None:
    """Every rank's shards of `state` into `folder` (collective: every rank calls it)."""
    import torch.distributed.checkpoint as dcp

    with _alone():
        dcp.save(state, storage_writer=_writer(folder), process_group=group, no_dist=not dist.is_initialized())


def start(folder: Path, state: Dict[str, Any], group: Any, stager: Optional[Any] = None):
    """The same, in the background: returns a future. The tensors are copied to host memory before it
    returns (by `stager`: DCP's own plain copy without one), so training may change them; the files are
    written on a thread, its collectives on `group`."""
    import torch.distributed.checkpoint as dcp

    return dcp.async_save(state, storage_writer=_writer(folder), process_group=group, async_stager=stager)


def _stager(checkpoints) -> Optional[Any]:
    """For shards on a GPU: DCP's stager into page-locked host memory, kept by the run from one save to the
    next (its copies are cached by the tensors' storages, which FSDP keeps), as torchtitan's
    `async_with_pinned_mem`. The copy ends before the save returns (no staging beside the next step: the
    optimizer would change what is being copied). On the CPU: none (DCP's plain copy)."""
    if checkpoints.stager is None and any(q.is_cuda for q in checkpoints.model.parameters()):
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        checkpoints.stager = DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                                                          use_async_staging=False, use_non_blocking_copy=False))
    return checkpoints.stager


def _writer(folder: Path) -> Any:
    """DCP's writer of a local folder (each file fsynced), or of an object store's prefix (s3torchconnector's
    or fsspec's: an object is stored whole once its upload completes; DCP's sync_files would sync the whole
    machine)."""
    import torch.distributed.checkpoint as dcp

    if storage.is_remote(folder) and s3_connector.carries(folder):
        return dcp_io.recording(s3_connector.dcp_writer(folder))
    if storage.is_remote(folder):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter  # not in dcp's namespace (torch 2.13)

        return dcp_io.recording(FsspecWriter(str(folder), sync_files=False, **storage.fresh(folder.protocol)))
    return dcp_io.recording(dcp.FileSystemWriter(folder, sync_files=True))


def own_files(folder: Path, rank: int) -> Dict[str, Dict[str, Any]]:
    """The size and CRC-32 of each file this rank wrote (rank 0: DCP's index too), for the manifest: kept as
    DCP wrote them (dcp_io.py), not read back."""
    names = [p.name for p in folder.glob(f"__{rank}_*.distcp")] + ([METADATA] if rank == 0 else [])
    return {name: dcp_io.written(folder / name) for name in names}


def read_run_state(checkpoints, folder: Path) -> None:
    read(folder, {"run": _Reading(checkpoints.run)})


def load(checkpoints, folder: Path) -> None:
    """The model's and optimizer's state, resharded to this run's (collective)."""
    strategy = checkpoints.strategy
    model_state, optimizer_state = strategy.state_dicts(checkpoints.model, checkpoints.optimizer)
    # A group's parameter names are saved once, by one rank: a pipeline stage's ranks name only their own.
    # This run's own are what its groups hold; the saved values (the learning rate, ...) are read.
    own = [list(group["params"]) for group in optimizer_state.get("param_groups", [])]
    try:
        read(folder, {"model": model_state, "optimizer": optimizer_state}, strategy.share)
    except DoesNotFit as e:
        raise UserError(f"checkpoint.resume: {folder} does not fit this run ({shown(e, 300)}); start over with "
                        f"checkpoint.resume=never") from None
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        if type(e).__name__ != "CheckpointException":
            raise
        raise run_state.does_not_fit(folder, e) from None
    for group, names in zip(optimizer_state.get("param_groups", []), own):
        group["params"] = names
    strategy.load_state_dicts(checkpoints.model, checkpoints.optimizer, model_state, optimizer_state, full=False)


class _Reading:
    """The run state as DCP's load sees it: a destination for its one value, without gathering RNG states."""

    def __init__(self, run: run_state.RunState):
        self.run = run

    def state_dict(self) -> Dict[str, Any]:
        return {"fields": b""}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.run.load_state_dict(state)


def read(folder: Path, state: Dict[str, Any], share: Any = None) -> None:
    """Load a sharded checkpoint into `state` (shaped as it was saved: each tensor the destination of its
    values, resharded to this run), in place. Collective when a process group runs. `share`: the part of the
    whole model's keys this rank holds (a pipeline stage's), where it holds a part."""
    import torch.distributed.checkpoint as dcp

    from launcher.checkpoint import dcp_safe

    reader = dcp_safe.reader(folder)
    if "model" in state:  # not the run state alone
        _check_fits(reader.metadata, state["model"], folder, share or (lambda keys: keys))
    with _alone():
        dcp.load(state, storage_reader=reader, planner=dcp_safe.WeightsOnly(), no_dist=not dist.is_initialized())


class DoesNotFit(ValueError):
    """The checkpoint's keys or shapes differ from the model's (the first difference)."""


def _check_fits(metadata: Any, model: Dict[str, Any], folder: Path, share: Any) -> None:
    """The model's keys and shapes against those the checkpoint's index holds: the first difference as
    one line, as for a full checkpoint (DCP itself would say only `CheckpointException ranks:...`). Every
    rank reads the same index, so every rank stops here, before any collective of the load."""
    saved = share(_tensors(metadata, "model."))
    peft = [key for key in saved if adapters.is_adapter_key(key)]
    if peft and not any(adapters.is_adapter_key(key) for key in model):
        raise DoesNotFit(adapters.merge_first(folder, peft[0]))
    for key, tensor in model.items():
        if key not in saved:
            raise DoesNotFit(f"'{key}' is missing from the checkpoint")
        if tuple(saved[key].size) != tuple(tensor.shape):  # a DTensor's shape is the whole tensor's
            raise DoesNotFit(f"'{key}' is {tuple(saved[key].size)} in the checkpoint, {tuple(tensor.shape)} in the model")
    extra = [key for key in saved if key not in model]
    if extra:
        raise DoesNotFit(f"the checkpoint has '{extra[0]}', which the model lacks")


def _tensors(metadata: Any, prefix: str) -> Dict[str, Any]:
    """The index entries of the tensors whose keys start with `prefix`, by key without it."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {key[len(prefix):]: meta for key, meta in metadata.state_dict_metadata.items()
            if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)}


@contextlib.contextmanager
def _alone() -> Iterator[None]:
    """DCP warns at every call without a process group that it assumes one process: that is meant here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*uninitialized")
        yield


def model_weights(folder: Path) -> Dict[str, torch.Tensor]:
    """The full model of a sharded checkpoint, joined from every rank's shards in this process: tensors
    only, each allocated from DCP's index and filled by DCP."""
    import torch.distributed.checkpoint as dcp

    from launcher.checkpoint import dcp_safe

    manifest.verified(folder)
    reader = dcp_safe.reader(folder)
    index = _tensors(reader.metadata, "model.")
    state = {f"model.{key}": torch.empty(meta.size, dtype=meta.properties.dtype) for key, meta in index.items()}
    with _alone():
        dcp.load(state, storage_reader=reader, no_dist=True)
    return {key[len("model."):]: tensor for key, tensor in state.items()}


def lazy_weights(folder: Path):
    """The model's tensors of a sharded checkpoint, read a few at a time (export --format hf): shapes and
    dtypes from DCP's index; each read loads those keys alone, from every rank's shards."""
    import torch.distributed.checkpoint as dcp

    from launcher.checkpoint import dcp_safe, hf

    manifest.verified(folder)
    index = _tensors(dcp_safe.reader(folder).metadata, "model.")

    def read(names: list) -> Dict[str, torch.Tensor]:
        state = {f"model.{n}": torch.empty(index[n].size, dtype=index[n].properties.dtype) for n in names}
        with _alone():
            dcp.load(state, storage_reader=dcp_safe.reader(folder), no_dist=True)
        return {n: state[f"model.{n}"] for n in names}

    return hf.Tensors({n: (torch.Size(m.size), m.properties.dtype) for n, m in index.items()}, read)
