"""The full format: rank 0 writes the whole state, gathered, as two files any process can read.

    checkpoints/step_<N>/model.pt   the plain model's state_dict
    checkpoints/step_<N>/state.pt   the optimizer's state keyed by parameter names, and the run state

In the background (checkpoint.async_save), rank 0 copies the state to host memory (staging.py) and a
thread of its own writes and seals it while training goes on; the other ranks write nothing."""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
from torch import nn

from launcher.checkpoint import files, fitting, layout, manifest, run_state
from launcher.model.plain import strip_prefixes

NAME = "full"


def holds(folder: Path) -> bool:
    return (folder / "model.pt").is_file() or (folder / "state.pt").is_file()


def model_weights(folder: Path) -> Dict[str, torch.Tensor]:
    manifest.verified(folder)
    return strip_prefixes(files.load(folder / "model.pt"))


def lazy_weights(folder: Path):
    """The model's tensors, memory-mapped: a tensor's bytes are read when it is written (export --format hf)."""
    from launcher.checkpoint import hf

    manifest.verified(folder)
    return hf.Tensors.of(strip_prefixes(files.load(folder / "model.pt", mmap=True)))


def write(folder: Path, step: int, model_state: Dict[str, torch.Tensor], state: Dict[str, Any], keep: int) -> Path:
    """The checkpoint of `step` in the checkpoints `folder`, complete (rank 0)."""
    partial = layout.prepare(folder, step)
    with layout.guarding(folder, step):
        listed = {"model.pt": files.save(partial / "model.pt", model_state),
                  "state.pt": files.save(partial / "state.pt", state)}
        return layout.seal(folder, step, listed, keep)


def save(checkpoints, step: int, final: bool, background: bool = False) -> None:
    """Every rank takes part in gathering the run state; rank 0 writes it all, and, when final, model.pt too
    (in the `background`: from its host copy, on a thread)."""
    strategy, optimizer = checkpoints.strategy, checkpoints.optimizer
    fields = checkpoints.run.fields()  # a collective
    model_state = strategy.model_state(checkpoints.model)
    # Whole on every rank (runs that write this format hold their state whole): keyed by parameter names
    # as DCP's get_state_dict keys it, without importing DCP for a run that never reads a shard.
    optimizer_state = named_optimizer_state(optimizer.state_dict(), strategy.unwrap(checkpoints.model), optimizer)
    if background:
        staged = checkpoints.staging.copy((model_state, {**fields, "optimizer": optimizer_state})) if checkpoints.writer else None
        checkpoints.pending = _Pending(checkpoints, step, staged)
        return

    def written() -> None:
        if checkpoints.writer:
            write(checkpoints.folder, step, model_state, {**fields, "optimizer": optimizer_state}, checkpoints.keep)
            if final:
                checkpoints.write_model(model_state)

    strategy.agree(written)  # no rank goes on before the checkpoint is complete, or all stop with its mistake


class _Pending:
    """A save that rank 0 writes on a thread (the other ranks wait for nothing but its outcome)."""

    def __init__(self, checkpoints, step: int, staged: Optional[tuple]):
        self.checkpoints, self.step, self.began = checkpoints, step, time.perf_counter()
        self.future = None
        if staged is not None:
            model_state, state = staged
            self.future = _thread().submit(write, checkpoints.folder, step, model_state, state, checkpoints.keep)

    def ready(self) -> bool:
        """Written (a collective: rank 0 says)."""
        return all(self.checkpoints.strategy.all_gather_object(self.future is None or self.future.done()))

    def seal(self) -> None:
        """Its outcome on every rank (write() sealed it): a failure as rank 0's UserError, everywhere."""
        self.checkpoints.strategy.agree(lambda: self.future.result() if self.future is not None else None)


_writer: Optional[concurrent.futures.ThreadPoolExecutor] = None


def _thread() -> concurrent.futures.ThreadPoolExecutor:
    """One thread writes the background saves of this process, one after another."""
    global _writer
    if _writer is None:
        _writer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
    return _writer


def read_run_state(checkpoints, folder: Path) -> None:
    checkpoints.run.loaded = run_state.load(folder / "state.pt", map_location=checkpoints.strategy.device)


def load(checkpoints, folder: Path) -> None:
    """The model's and optimizer's state, on every rank (its CRC-32s were checked when the folder was chosen)."""
    strategy, path = checkpoints.strategy, folder / "model.pt"
    plain = strategy.unwrap(checkpoints.model)
    model_state, _ = fitting.fit(strategy.share(files.load(path, strategy.device)), plain.state_dict(), path)
    optimizer_state = named_optimizer_state(checkpoints.run.loaded.pop("optimizer"), plain, checkpoints.optimizer)
    strategy.load_state_dicts(checkpoints.model, checkpoints.optimizer, model_state, optimizer_state, full=True)


def named_optimizer_state(state: Dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """An optimizer state_dict keyed by parameter names, as torch's set_state_dict takes it. Checkpoints
    written before the strategies owned their state hold optimizer.state_dict()'s indices instead: the
    i-th parameter of the optimizer's groups is the i-th index."""
    if all(isinstance(k, str) for k in state["state"]) and all(
            isinstance(p, str) for g in state["param_groups"] for p in g["params"]):
        return state
    names = {id(p): n for n, p in model.named_parameters()}
    order: List[str] = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    return {"state": {order[i]: s for i, s in state["state"].items()},
            "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in state["param_groups"]]}
