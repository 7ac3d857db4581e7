"""`python -m launcher.sweep report FOLDER`: one line per run of a sweep, to compare them at a glance: its
swept values, where it stands, its final losses and validation metrics, with --best KEY the best value of
one metric over its whole history (a run may have peaked before its end), and its wall time. As an aligned
table for the terminal, CSV for a spreadsheet or a script, or a Markdown table for a pull request.

Everything comes from what the runs wrote (launcher/sweep/folder.py reads it): a report may be taken at any
time, while the sweep runs too."""

from __future__ import annotations

import argparse
import csv
import io
import math
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from launcher.errors import UserError
from launcher.sweep.folder import Status, Sweep, read, status

FORMS = ("table", "csv", "markdown")
MARK = " *"  # after the best run's `best KEY` cell, in the table and Markdown forms
NONE = "-"


def rows(sweep: Sweep, best: Optional[str] = None, maximize: bool = False) -> List[Dict[str, str]]:
    """One row per run, in the sweep's order, as column -> text (see the module's docstring)."""
    return _rows(sweep, best, maximize)[0]


def _rows(sweep: Sweep, best: Optional[str], maximize: bool) -> Tuple[List[Dict[str, str]], Optional[int]]:
    """The rows, and the index of the run with the best value of `best` (the first of equals; None if none)."""
    statuses = [status(sweep.run_dir(run)) for run in sweep.runs]
    logged = sorted({key for s in statuses for line in s.history for key in line} - {"step", "time"})
    if best is not None and logged and best not in logged:
        # With nothing logged yet (a sweep just started) any key may still come: its column stays "-".
        raise UserError(f"--best {best}: no run of {sweep.folder} logged it; the keys logged: {', '.join(logged)}")
    vals = [key for key in logged if key.startswith("val/")]
    table, bests = [], []
    for run, s in zip(sweep.runs, statuses):
        row = dict(run.swept)
        row["status"] = s.describe()
        row["step"] = _step(s)
        for key in ["train/loss", *vals]:
            row[key] = _number(s.metrics.get(key))
        if best is not None:
            bests.append(_best(s.history, best, maximize))
            row[f"best {best}"] = _number(bests[-1])
        row["time"] = _duration(s.seconds)
        table.append(row)
    scored = [i for i, value in enumerate(bests) if value is not None]
    winner = (max if maximize else min)(scored, key=bests.__getitem__) if scored else None  # the first of equals
    return table, winner


def _step(s: Status) -> str:
    if s.last_step is None:
        return NONE
    return f"{s.last_step}/{s.total_steps}" if s.total_steps is not None else str(s.last_step)


def _number(value: Any) -> str:
    if value is None:
        return NONE
    return f"{value:.4f}" if isinstance(value, (int, float)) else str(value)


def _best(history: List[Dict[str, Any]], key: str, maximize: bool) -> Optional[float]:
    """The min (or max) of the key's finite values over every logged line: a NaN never wins."""
    values = [v for v in (line.get(key) for line in history) if isinstance(v, (int, float)) and math.isfinite(v)]
    if not values:
        return None
    return max(values) if maximize else min(values)


def _duration(seconds: Optional[float]) -> str:
    """12s, 3m04s, 1h02m: as precise as a glance at a sweep needs."""
    if seconds is None:
        return NONE
    whole = max(0, int(round(seconds)))
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


def render(rows: List[Dict[str, str]], form: str) -> str:
    """The rows as text in one of FORMS, without a final newline ("" for no rows)."""
    if form not in FORMS:
        raise ValueError(f"form {form!r}: expected one of {', '.join(FORMS)}")
    if not rows:
        return ""
    heads = list(rows[0])
    if form == "csv":
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=heads, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        return out.getvalue().rstrip("\n")
    cells = [heads] + [[row[h] for h in heads] for row in rows]
    if form == "markdown":
        cells = [[cell.replace("|", "\\|") for cell in line] for line in cells]
    widths = [max(len(line[i]) for line in cells) for i in range(len(heads))]
    lines = [[cell.ljust(w) for cell, w in zip(line, widths)] for line in cells]
    if form == "table":
        return "\n".join("  ".join(line).rstrip() for line in lines)
    body = ["| " + " | ".join(line) + " |" for line in lines]
    body.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(body)


def main(argv: List[str]) -> int:
    """`report FOLDER [--best KEY] [--max] [--csv | --markdown]` (argv without the word `report`): prints the
    report. A folder that is not a sweep's, or a --best key no run logged, raises UserError."""
    parser = argparse.ArgumentParser(
        prog="python -m launcher.sweep report",
        description="One line per run of a sweep: its swept values, status, step, final losses and val/ metrics, "
                    "wall time. Docs: docs/slurm-and-sweeps.md#sweeps (in the source tree).")
    parser.add_argument("folder", type=Path, help="the sweep's folder (the one holding sweep.json)")
    parser.add_argument("--best", metavar="KEY", help="add a column with the lowest value of KEY (e.g. val/loss) "
                                                      "over each run's whole history, and mark the best run with *")
    parser.add_argument("--max", dest="maximize", action="store_true",
                        help="with --best: the highest value is the best (e.g. val/accuracy)")
    forms = parser.add_mutually_exclusive_group()
    forms.add_argument("--csv", dest="form", action="store_const", const="csv", help="print CSV")
    forms.add_argument("--markdown", dest="form", action="store_const", const="markdown",
                       help="print a GitHub Markdown table")
    parser.set_defaults(form="table")
    args = parser.parse_args(list(argv))
    if args.maximize and args.best is None:
        parser.error("--max says which end of --best KEY is the best; give --best KEY too")
    table, winner = _rows(read(args.folder), args.best, args.maximize)
    if winner is not None and args.form != "csv":
        table[winner][f"best {args.best}"] += MARK
    print(render(table, args.form))
    return 0
