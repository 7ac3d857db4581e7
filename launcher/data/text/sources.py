"""Rows of local files, read as a stream (an iterator: a streamed dataset can take them as they come):
JSON Lines, JSON, CSV, Parquet, plain text, and an HF `datasets` dataset written by `save_to_disk`. Nothing is
downloaded.

`files` is a path, a glob or a list of them; each glob's matches are taken in sorted order, so that every rank
and every run reads the same rows in the same order. Each row comes as a `Row`: where it is ("chat.jsonl,
line 7"; lines for line-based files, rows counted from 1 for the others) and its value, a dict of columns, or
what is wrong with it (not JSON, not UTF-8, not an object). Whether a bad row stops the run or is skipped is
the reader's choice (the dataset's `bad_rows`): a source never raises for one row.

Where a row is not even a dict the source says so; which columns a row needs is the format's business."""

from __future__ import annotations

import csv
import glob
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Union

from launcher.errors import UserError, a_kind, first_line

SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".csv": "csv", ".parquet": "parquet",
            ".txt": "text", ".text": "text", ".md": "text"}
TEXT_ROWS = ("document", "line")  # a plain-text file as one row, or a row per line
BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True)
class Row:
    where: str  # the file and the row, for a message
    value: Optional[Dict[str, Any]]  # the row's columns; None when `problem` says why there are none
    problem: Optional[str] = None


def paths(files: Union[str, List[str]]) -> List[Path]:
    """The files (and saved datasets) `files` names, in order; one line for a name that matches nothing."""
    names = [files] if isinstance(files, str) else list(files)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise UserError(f"files: {files!r}: give a path, a glob (data/*.jsonl) or a list of them")
    out: List[Path] = []
    for name in names:
        if glob.has_magic(name):
            matched = sorted(glob.glob(str(Path(name).expanduser()), recursive=True))
            if not matched:
                raise UserError(f"files: {name!r} matches no file")
            out += [Path(m) for m in matched]
        elif not Path(name).expanduser().exists():
            raise UserError(f"files: {name}: no such file")
        else:
            out.append(Path(name).expanduser())
    for path in out:
        _kind(path)  # every name is checked before any is read: a mistake in the last shows at once
    return out


def rows(files: Union[str, List[str]], split: str = "train", text_rows: str = "document") -> Iterator[Row]:
    """Every row of `files`, file after file."""
    for path in paths(files):
        kind = _kind(path)
        if kind == "saved":
            yield from _saved(path, split)
        else:
            yield from READERS[kind](path, text_rows) if kind == "text" else READERS[kind](path)


def _kind(path: Path) -> str:
    if path.is_dir():
        if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
            return "saved"
        raise UserError(f"files: {path}: a folder, and not a dataset written by save_to_disk; name its files "
                        f"({path}/*.jsonl)")
    kind = SUFFIXES.get(path.suffix.lower())
    if kind is None:
        raise UserError(f"files: {path}: reads files ending in {', '.join(SUFFIXES)}, or a folder written by "
                        f"datasets' save_to_disk")
    return kind


def _lines(path: Path, replaced: bool = False) -> Iterator[tuple]:
    """(line number, the line decoded, None), or for a line that is not UTF-8 (number, None, why not);
    `replaced`: (number, the line decoded with U+FFFD for its bad bytes, why not)."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if number == 1 and raw.startswith(BOM):  # what spreadsheets write first; no part of the text
                raw = raw[len(BOM):]
            try:
                yield number, raw.decode("utf-8"), None
            except UnicodeDecodeError as e:
                problem = f"not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})"
                yield number, raw.decode("utf-8", "replace") if replaced else None, problem


def _line_at(raw: bytes, offset: int) -> int:
    return raw.count(b"\n", 0, offset) + 1


def _jsonl(path: Path) -> Iterator[Row]:
    for number, line, problem in _lines(path):
        where = f"{path}, line {number}"
        if problem is None and not line.strip():
            continue  # a blank line (a trailing newline, a separator) is no row
        yield _object(where, line.rstrip("\r\n")) if problem is None else Row(where, None, problem)


def _object(where: str, text: str) -> Row:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:  # the row is one line: its column is the line's
        return Row(where, None, f"not JSON ({e.msg} at column {e.colno})")
    except RecursionError:
        return Row(where, None, "not JSON that Python's parser reads: nested too deep")
    if not isinstance(value, dict):
        return Row(where, None, f"holds {a_kind(value)}; a row is a JSON object of columns")
    return Row(where, value)


def _json(path: Path) -> Iterator[Row]:
    """A JSON array of objects (read whole: JSON Lines is the streamed form), or JSON Lines in a .json file."""
    with open(path, "rb") as f:
        first = f.readline()
    if first.lstrip()[:1] != b"[":
        if _one_object_over_lines(path, first):
            raise UserError(f"{path}: one JSON object over several lines; a .json file holds an array of row "
                            f"objects, or one object per line")
        yield from _jsonl(path)
        return
    raw = path.read_bytes()
    try:
        value = json.loads(raw)
    except UnicodeDecodeError as e:
        yield Row(f"{path}, line {_line_at(raw, e.start)}", None, f"not UTF-8 (byte 0x{raw[e.start]:02x})")
        return
    except (ValueError, RecursionError) as e:
        raise UserError(f"{path}: not JSON ({first_line(e)[:200]}); a .json file holds an array of row objects, or "
                        f"one object per line") from None
    for number, item in enumerate(value, 1):
        where = f"{path}, row {number}"
        yield Row(where, item) if isinstance(item, dict) else \
            Row(where, None, f"holds {a_kind(item)}; a row is a JSON object of columns")


def _one_object_over_lines(path: Path, first: bytes) -> bool:
    """Whether a .json file that is not an array is a single object written over several lines (pretty-printed),
    rather than JSON Lines: its first line alone is not JSON, and the whole file is (read whole only then)."""
    try:
        json.loads(first)
        return False
    except (ValueError, RecursionError):
        pass
    try:
        return isinstance(json.loads(path.read_bytes()), dict)
    except (ValueError, RecursionError):
        return False


def _csv(path: Path) -> Iterator[Row]:
    """A header line naming the columns, then a row per record (a quoted field may span lines)."""
    bad: Dict[int, str] = {}

    def decoded() -> Iterator[str]:  # csv reads str: a line that is not UTF-8 is marked, and its record refused
        for number, line, problem in _lines(path, replaced=True):
            if problem is not None:
                bad[number] = problem
            yield line

    reader = csv.reader(decoded())
    try:
        header = next(reader, None)
        if header is None or bad:
            raise UserError(f"{path}: {bad.get(1, 'empty')}; a CSV file starts with a line naming its columns")
        last_line = reader.line_num
        for number, record in enumerate(reader, 1):
            where = f"{path}, row {number}"
            problems = [bad[n] for n in range(last_line + 1, reader.line_num + 1) if n in bad]
            last_line = reader.line_num
            if problems:
                yield Row(where, None, problems[0])
            elif len(record) != len(header):
                yield Row(where, None, f"has {len(record)} fields; the header names {len(header)}")
            else:
                yield Row(where, dict(zip(header, record)))
    except csv.Error as e:  # the file's structure (a NUL byte, an unclosed quote): no row after it can be trusted
        raise UserError(f"{path}, line {reader.line_num}: not CSV ({first_line(e)})") from None


def _parquet(path: Path) -> Iterator[Row]:
    import pyarrow
    import pyarrow.parquet as pq

    try:
        batches = pq.ParquetFile(str(path)).iter_batches(batch_size=1024)
        number = 0
        for batch in batches:
            for value in batch.to_pylist():
                number += 1
                yield Row(f"{path}, row {number}", value)
    except (pyarrow.ArrowException, OSError) as e:
        raise UserError(f"{path}: not a readable Parquet file ({first_line(e)[:200]})") from None


def _text(path: Path, text_rows: str) -> Iterator[Row]:
    """A plain-text file: one row (column `text`) of the whole file, or one per non-blank line."""
    if text_rows == "line":
        for number, line, problem in _lines(path):
            if problem is None and line.strip():
                yield Row(f"{path}, line {number}", {"text": line.rstrip("\r\n")})
            elif problem is not None:
                yield Row(f"{path}, line {number}", None, problem)
        return
    raw = path.read_bytes()
    try:
        yield Row(f"{path}", {"text": raw.decode("utf-8-sig")})
    except UnicodeDecodeError as e:
        yield Row(f"{path}, line {_line_at(raw, e.start)}", None, f"not UTF-8 (byte 0x{raw[e.start]:02x})")


def _saved(path: Path, split: str) -> Iterator[Row]:
    try:
        import datasets
    except ImportError:
        raise UserError(f"files: {path}: a dataset written by save_to_disk needs the datasets package: pip install "
                        f"-c constraints.txt -e '.[datasets]'") from None
    try:
        loaded = datasets.load_from_disk(str(path))
    except (OSError, ValueError) as e:
        raise UserError(f"files: {path}: datasets cannot load it ({first_line(e)[:200]})") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise UserError(f"split: {split!r} is not a split of {path}; it has {', '.join(loaded)}")
        loaded = loaded[split]
    for number, value in enumerate(loaded, 1):
        yield Row(f"{path}, row {number}", value)


READERS = {"jsonl": _jsonl, "json": _json, "csv": _csv, "parquet": _parquet, "text": _text}
