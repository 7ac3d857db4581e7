"""Python's cyclic garbage collector while a `python -m launcher` process starts.

Importing torch, its distributed pieces and the recipe's libraries makes hundreds of thousands of objects, none of
them garbage, and the collector sweeps them again and again as they appear: a fifth of a rank's CPU before its first
step (python -m launcher.bench's start-up row). The command pauses it while it starts; training resumes it, with
everything alive by then (modules, the model, the optimizer) frozen out of its later sweeps, as forking servers do
(`gc.freeze`). A process that never paused it (the launcher's functions called from a user's code) is untouched."""

import gc

_paused = False


def pause() -> None:
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def resume() -> None:
    """Before training (or before waiting on torchrun's workers): the collector as it was, minus what is alive now."""
    global _paused
    if _paused:
        _paused = False
        gc.freeze()
        gc.enable()
