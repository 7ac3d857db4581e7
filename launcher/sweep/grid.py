"""A sweep's grid from the command line, in Hydra's multirun syntax: `key=a,b,c` sweeps a key over values,
`key=range(1,4)` over 1, 2, 3 (range([start, ]stop[, step]), Python's), a value holding a comma is quoted
('a,b') or bracketed ([1,2] is one list value; [1,2],[3,4] two); any other `key=value` applies to every run.
The runs are every combination, the first axis slowest; each is named by its swept values alone, so an empty
value (a stray comma, which Hydra's grammar refuses too) and a value given twice (two runs of one folder) are
mistakes."""

from __future__ import annotations

import hashlib
import itertools
import re
from dataclasses import dataclass
from typing import Dict, List, Tuple

from launcher.errors import UserError

RANGE = re.compile(r"range\(\s*(-?\d+)\s*(?:,\s*(-?\d+)\s*(?:,\s*(-?\d+)\s*)?)?\)")
SAFE = re.compile(r"[\w.\-=,+]+")  # what a run's folder name may hold as it is; else a short stable id
LONGEST = 120


@dataclass(frozen=True)
class Run:
    name: str  # its folder's name under the sweep's, e.g. lr=0.001,seed=1
    swept: Tuple[Tuple[str, str], ...]  # (key, value) of each swept key, as typed

    @property
    def overrides(self) -> List[str]:
        return [f"{key}={value}" for key, value in self.swept]


def split(args: List[str]) -> Tuple[Dict[str, List[str]], List[str]]:
    """(the swept keys with their values, in order; the overrides every run takes), or a UserError naming
    every mistake of the grid at once."""
    axes: Dict[str, List[str]] = {}
    plain: List[str] = []
    problems: List[str] = []
    for arg in args:
        key, eq, value = arg.partition("=")
        if not eq or not key:
            problems.append(f"{arg!r}: expected key=value (key=a,b,c to sweep a key)")
            continue
        if value.strip().startswith("range(") and not RANGE.fullmatch(value.strip()):
            problems.append(f"{arg}: a range takes integers: range(stop), range(start, stop) or "
                            f"range(start, stop, step)")
            continue
        try:
            values = _values(value)
        except UserError as e:
            problems += e.problems
            continue
        if not values:
            problems.append(f"{arg}: the range holds no value (range(start, stop) counts up from start to stop - 1)")
        elif len(values) > 1 or RANGE.fullmatch(value.strip()):
            problems += _repeated(arg, values)
            if key in axes:
                problems.append(f"{key}: swept twice ({key}={','.join(axes[key])} and {arg}); give its values once")
            axes.setdefault(key, values)
        else:
            plain.append(arg)
    for arg in plain:
        key = arg.partition("=")[0]
        if key in axes:  # the later one would win in every run: runs that differ by name alone
            problems.append(f"{key}: swept ({key}={','.join(axes[key])}) and set for every run ({arg}); give it once")
    if problems:
        raise UserError(*problems)
    return axes, plain


def _repeated(arg: str, values: List[str]) -> List[str]:
    """An empty value between commas (a stray comma: Hydra's grammar refuses it too) or a value given twice
    (both runs would be one folder: the second would find it locked, or done), each one line."""
    if any(not v.strip() for v in values):
        return [f"{arg}: an empty value between commas (a stray comma?); to sweep an empty string, quote it: ''"]
    twice = sorted({v for v in values if values.count(v) > 1}, key=values.index)
    hint = "" if arg.startswith("seed=") else " (to repeat a run, sweep its seed: seed=range(3))"
    return [f"{arg}: {v} is given {values.count(v)} times; each value is one run in a folder of its own, so give it "
            f"once{hint}" for v in twice]


def _values(value: str) -> List[str]:
    found = RANGE.fullmatch(value.strip())
    if found:
        start, stop, step = (int(g) if g is not None else None for g in found.groups())
        if step == 0:
            raise UserError(f"{value}: a range's step cannot be 0")
        if stop is None:  # range(stop), as Python's
            start, stop = 0, start
        return [str(v) for v in range(start, stop, step or 1)]
    parts, depth, quote, current = [], 0, None, ""
    for char in value:
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "[{(":
            depth += 1
        elif char in "]})":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(current)
            current = ""
            continue
        current += char
    return parts + [current]


def runs(axes: Dict[str, List[str]]) -> List[Run]:
    """Every combination, the first axis varying slowest."""
    keys = list(axes)
    out = [_run(tuple(zip(keys, combination))) for combination in itertools.product(*axes.values())]
    named: Dict[str, Run] = {}
    for run in out:  # a backstop: split refuses a value given twice, so two names alike are two spellings
        first = named.setdefault(run.name, run)
        if first is not run:
            raise UserError(f"{' '.join(first.overrides)} and {' '.join(run.overrides)}: both runs would be the "
                            f"folder {run.name}/; give each value once")
    return out


def _run(swept: Tuple[Tuple[str, str], ...]) -> Run:
    name = ",".join(f"{key.rpartition('.')[2] if _short_unique(key, swept) else key}={value}" for key, value in swept)
    if not SAFE.fullmatch(name) or len(name) > LONGEST:
        name = "run-" + hashlib.sha1(repr(swept).encode()).hexdigest()[:10]  # sweep.json names its overrides
    return Run(name or "run", swept)


def _short_unique(key: str, swept: Tuple[Tuple[str, str], ...]) -> bool:
    """Whether the key's last part (lr for optimizer.lr) names it alone among the swept keys."""
    last = key.rpartition(".")[2]
    return sum(k.rpartition(".")[2] == last for k, _ in swept) == 1
