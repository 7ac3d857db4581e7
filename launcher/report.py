"""How a line reaches the user: which rank says it, its `launcher:` prefix on stderr, and the error file
torchrun's failure report reads. Every command (training, export, slurm) says things through here."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import List, Optional

from launcher.errors import UserError

RANK0_GRACE = 30  # seconds a rank leaves rank 0, on its node, to say a mistake both met before saying it itself


def rank() -> str:
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))


def mistake(e: UserError) -> None:
    """Say a mistake once per run: rank 0 says it, and another rank too unless it knows rank 0 says the same."""
    here = rank()
    # Under a real torchrun every rank meets the same recipe problem; an agreed one every rank learnt of.
    rank0_says_it = not e.every_rank and (e.agreed or "TORCHELASTIC_RUN_ID" in os.environ)
    if here != "0" and rank0_says_it and _leave_it_to_rank0("the mistake"):
        return
    for problem in e.problems:
        _print(problem, prefixed=here != "0" or (e.every_rank and _several()))
    for_torchrun([f"launcher: {p}" for p in e.problems])


def agreed(message: str) -> None:
    """A line every rank meets at the same step (a value all-reduced, as the training loss): rank 0 says it."""
    if rank() != "0":
        if _several():
            _leave_it_to_rank0("the line")
        return
    _print(message, prefixed=False)
    for_torchrun([f"launcher: {message}"])


def _leave_it_to_rank0(what: str) -> bool:
    """Whether rank 0 said it (or, on another node, may have): False where rank 0 shares this node and has not
    said it in time, having met something else (a stage of a pipeline waiting for this one), so this rank must."""
    # Dated later than rank 0's: torchrun names the earliest error file as the root cause, and both
    # are written within the same second or two.
    for_torchrun([f"launcher: rank 0 reports {what}"], later=60)
    # torchrun stops every rank as soon as one exits: give rank 0, busy with the same work, the moment it
    # needs to say it. On rank 0's node its error file, written once its line is printed, says when (a
    # loaded machine's rank 0 can still be importing torch seconds after this one met the mistake).
    rank0 = _rank0_error_file()
    deadline = time.monotonic() + (RANK0_GRACE if rank0 else 3)
    while time.monotonic() < deadline and not (rank0 and rank0.exists()):
        time.sleep(0.05)
    return rank0 is None or rank0.exists()


def _rank0_error_file() -> Optional[Path]:
    """Rank 0's torchrun error file where this rank shares its node (torchrun keeps a folder per local rank,
    .../attempt_N/<local rank>/error.json, and node 0's local rank 0 is rank 0); None elsewhere."""
    ours = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not ours or os.environ.get("LOCAL_RANK") != rank():
        return None
    path = Path(ours)
    return path.parent.parent / "0" / path.name if path.parent.name == rank() else None


def say(message: str, every_rank: bool = False) -> None:
    """A line that rank 0 says for every rank, or with every_rank, each rank for itself."""
    if rank() == "0" or every_rank:
        _print(message, prefixed=every_rank and _several())


def _several() -> bool:
    return os.environ.get("WORLD_SIZE", "1") != "1"


def _print(message: str, prefixed: bool) -> None:
    prefix = f"[rank {rank()}] " if prefixed else ""
    print(f"{prefix}launcher: {message}", file=sys.stderr, flush=True)


def for_torchrun(lines: List[str], later: int = 0) -> None:
    """torchrun's failure report shows a worker's error file, else "To enable traceback see: ...": give it
    our lines, in the format of torch's own ErrorHandler, so the report names the mistake."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    text = "\n".join(lines)
    data = {"message": {"message": text, "extraInfo": {"py_callstack": text, "timestamp": str(int(time.time()) + later)}}}
    # Whole or absent: torchrun stops the other ranks as soon as one exits, and reads the file of a rank it
    # stopped mid-write; an empty one made its report fail on json (exit 1 instead of the rank's 2).
    partial = f"{path}.{os.getpid()}.partial"
    try:
        with open(partial, "w") as f:
            json.dump(data, f)
        os.replace(partial, path)
    except OSError:
        pass  # the report then says what it says without it; our line is on stderr already


def where_raised(e: BaseException) -> str:
    """Where an exception was raised, as file:line in function (the component's code, not ours)."""
    import traceback

    frames = traceback.extract_tb(e.__traceback__)
    # sys.exit wrapped by a library's hook (wandb replaces it once a run was started): its caller
    while len(frames) > 1 and frames[-1].name == "exit":
        frames.pop()
    return f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else "a component"
