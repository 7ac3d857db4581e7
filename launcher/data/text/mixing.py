"""What a mixture of text sources is made of, apart from reading them: the recipe's sources checked (each a
weight and its own settings over the shared ones), each source's count of an epoch from the weights, the order
a source's rows are drawn in, and the order streamed sources are interleaved in.

Weights are shares, relative to each other (0.7 and 0.3, or 7 and 3): an epoch of N samples gives source s
`N * w_s / sum(w)` of them, rounded by largest remainder (the counts add up to N; ties to the earlier source).

A source's rows are drawn as one endless sequence of passes, each pass a fresh permutation of its rows drawn
from (seed, source, pass): draw d of source s is row `order(s, d // n_s)[d % n_s]`. Epoch e of a map-style
mixture takes draws `e * c_s` to `(e + 1) * c_s - 1` of each source: no row comes twice before every row has
come once (a source given fewer samples than its rows shows other rows each epoch; one given more shows each
row `c_s / n_s` times, in fresh orders).

Streams are interleaved in blocks of BLOCK items: the sources of a block are the next BLOCK picks of the
largest-deficit rule (each item goes to the source furthest behind its share, ties to the earlier source: after
any whole number of blocks each source is within one item of its share), shuffled within the block from
(seed, epoch, block)."""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from launcher.data import item_rng

BLOCK = 1000
SALT = 0x6D69787475726521  # the draws' keys set apart from the items' (item_rng.key of the same seed)


def specs(sources: Any, shared: Dict[str, Any], per_source: Sequence[str]) -> List[Tuple[float, Dict[str, Any]]]:
    """(weight, settings) of each source: its own settings over the shared ones; ValueError naming the key of a
    mistake (no sources, a weight that is not a positive number, a key a source cannot have)."""
    if isinstance(sources, dict) or not isinstance(sources, (list, tuple)) or not sources:
        raise ValueError(f"sources: {sources!r}: a list of sources, each {{files: ..., weight: ...}} and its own "
                         f"settings ({', '.join(per_source)})")
    for name in shared:
        if name not in per_source:
            raise ValueError(f"{name}: not a setting of a mixture; its sources take {', '.join(per_source)}")
    made = []
    for i, source in enumerate(sources):
        if not isinstance(source, dict):
            raise ValueError(f"sources.{i}: {source!r}: a mapping such as {{files: a.jsonl, weight: 0.5}}")
        for name in source:
            if name != "weight" and name not in per_source:
                raise ValueError(f"sources.{i}.{name}: not a setting of a source; one of weight, "
                                 f"{', '.join(per_source)}")
        weight = source.get("weight")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) \
                or weight <= 0:
            missing = "missing" if "weight" not in source else repr(weight)
            raise ValueError(f"sources.{i}.weight: {missing}: a positive number, the source's share of the samples "
                             f"relative to the other sources' weights")
        settings = {**shared, **{k: v for k, v in source.items() if k != "weight"}}
        if "files" not in settings:
            raise ValueError(f"sources.{i}.files: missing; the source's files (a path, a glob or a list of them)")
        made.append((float(weight), settings))
    return made


def counts(weights: Sequence[float], total: int) -> List[int]:
    """Each source's samples of `total`, in proportion to `weights`, rounded by largest remainder."""
    whole = sum(weights)
    exact = [total * w / whole for w in weights]
    taken = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda s: (-(exact[s] - taken[s]), s))
    for s in by_remainder[:total - sum(taken)]:
        taken[s] += 1
    return taken


def order(seed: int, source: int, pass_: int, rows: int) -> np.ndarray:
    """Pass `pass_` of source `source`: its `rows` rows in the order drawn from (seed, source, pass)."""
    generator = np.random.Generator(np.random.PCG64(item_rng.key(seed ^ SALT, pass_, source)))
    return generator.permutation(rows)


class Orders:
    """The passes asked for lately, kept (an epoch asks for the same few again and again, in any order)."""

    def __init__(self, seed: int, keep: int = 64):
        self.seed, self.keep, self.held = seed, keep, {}

    def row(self, source: int, drawn: int, rows: int) -> int:
        """The row of draw `drawn` of a source of `rows` rows."""
        pass_, at = divmod(drawn, rows)
        held = self.held.get((source, pass_))
        if held is None:
            if len(self.held) >= self.keep:
                self.held.pop(next(iter(self.held)))
            held = self.held[(source, pass_)] = order(self.seed, source, pass_, rows)
        return int(held[at])


def block(weights: Sequence[float], before: Sequence[int], seed: int, epoch: int, number: int) -> List[int]:
    """The sources of block `number` of a streamed epoch, where `before[s]` items of source s came before it."""
    whole, taken, picks = sum(weights), list(before), []
    start = sum(before)
    for i in range(start, start + BLOCK):
        # the source furthest behind its share once this item is placed; ties to the earlier source
        s = max(range(len(weights)), key=lambda s: ((i + 1) * weights[s] / whole - taken[s], -s))
        taken[s] += 1
        picks.append(s)
    generator = np.random.Generator(np.random.PCG64(item_rng.key(seed ^ SALT, epoch, number) ^ 1))
    return [picks[i] for i in generator.permutation(BLOCK)]


def sources_lines(sources: Sequence[Any]) -> List[str]:
    """Each source's own lines at start under its key (`sources.<i>: ...`); a line two sources share (the
    tokenizer's, the same for every source of one format) said once."""
    said, lines = set(), []
    for i, source in enumerate(sources):
        for line in source.notes:
            if line not in said:
                lines.append(f"sources.{i}: {line}")
                said.add(line)
    return lines


def named(settings: Dict[str, Any]) -> str:
    files = settings["files"]
    return files if isinstance(files, str) else ", ".join(map(str, files))


def share(count: int, total: int) -> str:
    return f"{100 * count / max(total, 1):.1f}%"


def about(value: Optional[float]) -> str:
    return "?" if value is None else f"{value:,.0f}"
