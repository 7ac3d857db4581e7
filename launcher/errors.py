"""The one exception type for user mistakes, and the exit codes the command line gives.

0 done; 1 a bug or crash (Python's traceback); 2 a user mistake, one line per problem; 3 the loss
diverged; 4 Slurm refused the requeue after a signal; 5 out of memory; 6 a collective timed out; 7 checkpoints
could not be saved, save after save; 128+N stopped by signal N (see cli.py).
"""

from __future__ import annotations

import reprlib

EXIT_BUG = 1  # what Python itself gives an uncaught exception: named here, never returned by hand
EXIT_USER = 2
EXIT_DIVERGED = 3
EXIT_REQUEUE = 4
EXIT_OOM = 5
EXIT_HUNG = 6
EXIT_CHECKPOINTS = 7


class UserError(Exception):
    """A mistake in a recipe, the command line, the environment or a checkpoint.

    Holds one or more problems, each a complete line naming where it is (file,
    key, variable) and what would be valid. Never carries a traceback to the user.
    """

    def __init__(self, *problems: str, every_rank: bool = False, agreed: bool = False):
        self.problems = _from_worker([p for p in problems if p])
        # Most mistakes are the same on every rank, and rank 0 alone reports them; a problem of
        # one rank's own (its device, its environment) is reported by that rank.
        self.every_rank = every_rank
        # Every rank has learnt of it through a collective (Strategy.agree), so rank 0 reports it.
        self.agreed = agreed
        super().__init__("\n".join(self.problems))


WORKER = "Caught UserError in DataLoader worker process"
RAISED = "\nlauncher.errors.UserError: "


def _from_worker(problems: list) -> list:
    """The problems a loader worker met (a stream's bad row), where torch raises them again in the main process
    as UserError(its own first line and the worker's traceback): what the worker's UserError said, without it."""
    if len(problems) != 1 or not problems[0].startswith(WORKER) or RAISED not in problems[0]:
        return problems
    return [line for line in problems[0].rsplit(RAISED, 1)[1].splitlines() if line]


def first_line(e: object) -> str:
    """The first line of an exception's message (or of any text): messages to users are one line."""
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def shown(text: object, most: int = 200) -> str:
    """Text read from a file or a store (a lock's holder, a manifest's names, a saved recipe's values) as a
    message quotes it: every character that is not printable (a newline, a terminal's escape, a bidirectional
    override) written as its escape (\\n, \\x1b, \\u202e), so that a file can neither add a line to the
    console nor steer the terminal; at most `most` characters of it."""
    text = given = str(text)
    if not text.isprintable():
        text = "".join(c if c.isprintable() else c.encode("unicode_escape", "backslashreplace").decode() for c in text)
    return text if len(text) <= most else f"{text[:most]}... ({len(given)} characters)"


def short(value: object) -> str:
    """repr(value), cut to a readable length: a message quotes what the user gave, which may be huge."""
    cut = reprlib.Repr()
    cut.maxstring = cut.maxother = cut.maxlong = 80
    return cut.repr(value)


def a_kind(value: object) -> str:
    """'a list', 'an int': the type of what was given, for a message."""
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


class TrainingDiverged(Exception):
    """The loss became NaN or infinite; the run stops without saving over good checkpoints."""


class OutOfMemory(Exception):
    """A rank ran out of device (or host) memory in a step; the message is its one line. Nothing is saved
    after it: the newest complete checkpoint stays the one to resume from."""


class Hung(Exception):
    """A collective did not finish within dist_timeout (another rank stopped, hung or died); the message
    is this rank's one line (exit code 6)."""


class NoQuorum(Hung):
    """Fault tolerance: no quorum came for the next step (too few groups live, or the lighthouse lost). Every rank
    of the group meets it at the same step boundary, with the state of the last committed step, whole: saved before
    the group stops (exit code 6)."""


class CheckpointsFailed(Exception):
    """Saves failed one after another (an object store gone, a disk refusing writes): the run stops with what
    is sealed; the message is the one line every rank gives (exit code 7)."""


class PeerFailed(Exception):
    """Another rank failed first and said why; this rank's collective then failed for want of it. Nothing is
    printed (the cause stays the last error on the screen); the exit code is a bug's, 1."""
