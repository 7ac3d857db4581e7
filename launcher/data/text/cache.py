"""The cache of tokenized samples: a dataset's files tokenized once, then read back by a second run and by every
rank, as long as nothing that shapes the samples changed.

An entry is one safetensors file, `<folder>/<name>.safetensors`: the samples' tokens end to end (`input_ids`,
`labels`, int32) and each sample's length (`lengths`, int64), with, in its JSON header's metadata, the key it
was made under, the counts the dataset's lines at start are made of, and a CRC-32 of the arrays. Its name is a
hash of where the samples come from (the files as named and found, the tokenizer's folder, every setting that
changes a sample, the chat template used); what they hold (each file's size and SHA-256, the tokenizer
files' SHA-256, the library versions that tokenize and render) is checked against the entry's key, so a
changed file or tokenizer rebuilds its entry in place rather than leaving an orphan beside it.

Files are known by their content, not their mtime: a file whose bytes changed is re-tokenized even where its
size and mtime were put back (os.utime), and one only touched (a git checkout, a copy) is not. Hashing reads
every file once per run on every rank (SHA-256: hundreds of MB/s on one core): seconds for gigabytes, where
tokenizing them takes minutes.

An entry is read as untrusted input (DESIGN, invariant 13): safetensors checks the header (its size, every
tensor's dtype, shape and offsets inside the file) before anything is read, nothing in it is code, and the
arrays' dtypes, shapes, sums and CRC are checked before one sample is made. An entry that fails is said in one
line and rebuilt. The folder is trusted for its contents all the same: the CRC-32 detects damage, not
forgery, and an entry written under the right key with a valid CRC is used, as the data files are; whoever may
write the folder decides what a run trains on. Entries are written to a temporary file and renamed into place
(os.replace), so ranks writing at once, or a run killed mid-write, never leave half an entry (at most a
`.partial` file), with the mode a new file gets from the umask (a team's shared folder, umask 002, serves every
member); ranks wait on a lock (flock, beside the entry) while one of them tokenizes, then read what it wrote."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import zlib
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from launcher.errors import first_line

# of the entry's layout and of what a sample is made of: a change here invalidates every entry (2: a row's tools
# passed to the chat template, weights, text parts, rows over max_len's characters refused; counts of rows with
# nothing to learn, what the template never reads, the largest token)
VERSION = 2
IGNORE = -100  # a label where no loss is taken (formats.IGNORE: the cache knows nothing of the formats)
ARRAYS = {"input_ids": "I32", "labels": "I32", "lengths": "I64"}
LIBRARIES = ("tokenizers", "transformers", "jinja2")  # whose versions may change a token or a rendered text
CHANGED = {"files": "the files changed", "tokenizer": "the tokenizer changed",
           "libraries": "another version of tokenizers, transformers or jinja2"}
Samples = List[Dict[str, List[int]]]
Made = Tuple[Samples, Dict[str, Any]]  # the samples and the counts the lines at start are made of


@dataclass(frozen=True)
class Key:
    where: Dict[str, Any]  # what the entry's name is a hash of
    held: Dict[str, Any]  # what the files and the tokenizer hold, checked against the entry's

    @property
    def name(self) -> str:
        return hashlib.sha256(_canonical(self.where).encode()).hexdigest()[:32]

    def as_json(self) -> str:
        return _canonical({"version": VERSION, "where": self.where, "held": self.held})


def folder(given: Any, env=os.environ) -> Optional[Path]:
    """The folder `cache` names: none (null, false), the default (true), or the given one. The default is, as
    HF datasets picks its own: $LAUNCHER_CACHE/text, else $XDG_CACHE_HOME/launcher/text, else
    ~/.cache/launcher/text."""
    if given is None or given is False:
        return None
    if given is True:
        if env.get("LAUNCHER_CACHE"):
            return Path(env["LAUNCHER_CACHE"]).expanduser() / "text"
        return Path(env.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "launcher" / "text"
    return Path(given).expanduser()


def key(files: List[Path], tokenizer: Path, tokenizer_files: List[Path], settings: Dict[str, Any]) -> Key:
    """The key of the samples that `files` make with the tokenizer of that folder (read from those of its
    files that exist) under `settings` (each a JSON value: what changes a sample, the chat template used)."""
    where = {"files": [str(p.resolve()) for p in files], "tokenizer": str(tokenizer.resolve()), "settings": settings}
    held = {"files": [_held(p) for p in files],
            "tokenizer": _digest([(str(p.relative_to(tokenizer)), p) for p in tokenizer_files if p.is_file()]),
            "libraries": {name: _version(name) for name in LIBRARIES}}
    # as JSON gives them back (tuples as lists, keys as strings), so that an entry's key compares equal
    return Key(json.loads(_canonical(where)), json.loads(_canonical(held)))


def cached(root: Optional[Path], made_under: Optional[Key],
           build: Callable[[], Made]) -> Tuple[Samples, Dict[str, Any], str]:
    """The samples and counts of the entry for `made_under` in `root`, or those `build` makes (then written
    there), and the line that says which."""
    if root is None or made_under is None:
        samples, counts = build()
        return samples, counts, f"tokenized {_rows(counts)}, not cached (cache: null)"
    path = root / f"{made_under.name}.safetensors"
    found, why = read(path, made_under)
    if found is not None:
        return (*found, f"cache: hit {path}")
    with contextlib.ExitStack() as lock:
        try:
            root.mkdir(parents=True, exist_ok=True)
            lock.enter_context(_locked(path.with_suffix(".lock")))
        except OSError as e:  # a folder that cannot be written: the run goes on, tokenizing as without a cache
            samples, counts = build()
            return samples, counts, f"tokenized {_rows(counts)}, not cached: {root}: {first_line(e)}"
        found, _ = read(path, made_under)  # another rank may have written it while this one waited
        if found is not None:
            return (*found, f"cache: hit {path}")
        samples, counts = build()
        try:
            write(path, made_under, samples, counts)
        except OSError as e:
            return samples, counts, f"tokenized {_rows(counts)}, not cached: {path}: {first_line(e)}"
    if why is not None and why.startswith("unreadable"):
        return samples, counts, f"cache: {path}: {why}; tokenized {_rows(counts)} anew and cached there"
    return samples, counts, f"tokenized {_rows(counts)}{f' ({why})' if why else ''}, cached at {path}"


def read(path: Path, wanted: Key) -> Tuple[Optional[Made], Optional[str]]:
    """The entry's samples and counts where it is whole and of `wanted`'s key; else None and why not (None:
    there is no entry)."""
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        return None, None
    try:
        with safe_open(str(path), framework="np") as f:
            meta = f.metadata() or {}
            stored = json.loads(meta.get("key", "null"))
            if not isinstance(stored, dict) or stored.get("where") != wanted.where:
                return None, "unreadable: its key is not this dataset's"
            if stored.get("version") != VERSION or stored.get("held") != wanted.held:
                return None, _changed(stored, wanted)
            _shapes(f)
            arrays = {name: f.get_tensor(name) for name in ARRAYS}
        counts = json.loads(meta["counts"])
        _whole(arrays, counts, meta.get("crc32"))
    except (SafetensorError, OSError, ValueError, KeyError, TypeError, RecursionError) as e:
        return None, f"unreadable ({first_line(e)[:200]})"
    return (_samples(arrays), counts), None


def write(path: Path, under: Key, samples: Samples, counts: Dict[str, Any]) -> None:
    """The entry, written whole or not at all: to a temporary file beside it, flushed, renamed into place."""
    import numpy as np
    from safetensors.numpy import save_file

    arrays = {"input_ids": np.array([t for s in samples for t in s["input_ids"]], dtype=np.int32),
              "labels": np.array([t for s in samples for t in s["labels"]], dtype=np.int32),
              "lengths": np.array([len(s["input_ids"]) for s in samples], dtype=np.int64)}
    meta = {"key": under.as_json(), "counts": json.dumps(counts), "crc32": str(_crc(arrays))}
    # the mode open() gives a new file here (the umask's): safetensors writes 0600, which serves its writer alone
    temporary = str(path.parent / f".{path.stem}.{os.getpid()}.{secrets.token_hex(4)}.partial")
    os.close(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    mode = os.stat(temporary).st_mode & 0o777
    try:
        save_file(arrays, temporary, metadata=meta)
        os.chmod(temporary, mode)
        with open(temporary, "rb") as f:
            os.fsync(f.fileno())
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def _shapes(f) -> None:
    """The entry holds exactly the three arrays, one-dimensional, of their dtypes (before any is read)."""
    names = set(f.keys())
    if names != set(ARRAYS):
        raise ValueError(f"it holds {', '.join(sorted(names)) or 'nothing'}; an entry holds {', '.join(ARRAYS)}")
    for name, dtype in ARRAYS.items():
        piece = f.get_slice(name)
        if piece.get_dtype() != dtype or len(piece.get_shape()) != 1:
            raise ValueError(f"{name} is {piece.get_dtype()} of shape {piece.get_shape()}; it is 1-D {dtype}")


def _whole(arrays: Dict[str, Any], counts: Any, crc: Optional[str]) -> None:
    """The arrays and counts are an entry's as written: the counts of the lines at start, the samples' lengths
    adding up to the tokens, the CRC-32 of the arrays."""
    lengths = arrays["lengths"]
    numbers = ("rows", "skipped", "over", "lost", "empty", "samples", "largest")
    if not isinstance(counts, dict) or set(counts) != {*numbers, "first", "unread"} \
            or not isinstance(counts["first"], str) or not isinstance(counts["unread"], list) \
            or not all(type(counts[n]) is int and counts[n] >= 0 for n in numbers) \
            or not all(isinstance(u, str) for u in counts["unread"]):
        raise ValueError(f"its counts ({str(counts)[:80]}) are not those an entry holds")
    if counts["samples"] != len(lengths):
        raise ValueError(f"its counts say {counts['samples']} samples; it holds {len(lengths)}")
    if len(lengths) == 0 or int(lengths.min()) < 1 or int(lengths.sum()) != len(arrays["input_ids"]) \
            or len(arrays["labels"]) != len(arrays["input_ids"]):
        raise ValueError("its lengths do not add up to its tokens")
    if crc != str(_crc(arrays)):
        raise ValueError("its arrays do not match their CRC-32")
    # (a forged entry's CRC is its forger's: ids the tokenizer never gives would reach the model's embedding)
    if int(arrays["input_ids"].min()) < 0:
        raise ValueError(f"it holds the token id {int(arrays['input_ids'].min())}; a token id is 0 or more")
    labels = arrays["labels"]
    if bool(((labels != IGNORE) & (labels != arrays["input_ids"])).any()):
        raise ValueError(f"it holds labels that are neither their token nor {IGNORE}")
    if int(arrays["input_ids"].max()) != counts["largest"]:
        raise ValueError(f"its counts say its largest token is {counts['largest']}; it holds "
                         f"{int(arrays['input_ids'].max())}")


def _samples(arrays: Dict[str, Any]) -> Samples:
    ids, labels = arrays["input_ids"].tolist(), arrays["labels"].tolist()
    samples, at = [], 0
    for length in arrays["lengths"].tolist():
        samples.append({"input_ids": ids[at:at + length], "labels": labels[at:at + length]})
        at += length
    return samples


def _changed(stored: Dict[str, Any], wanted: Key) -> str:
    """What differs between the entry there and the samples wanted, in a few words."""
    if stored.get("version") != VERSION:
        return "the entry there was of an older cache layout"
    held = stored["held"] if isinstance(stored.get("held"), dict) else {}
    what = [said for name, said in CHANGED.items() if held.get(name) != wanted.held[name]]
    return f"{' and '.join(what) or 'its contents changed'} since the entry there was made"


def _held(path: Path) -> Dict[str, Any]:
    """A file's (or a save_to_disk folder's) size and SHA-256 of its bytes."""
    if path.is_dir():
        parts = sorted(p for p in path.rglob("*") if p.is_file())
        return {"size": sum(p.stat().st_size for p in parts),
                "sha256": _digest([(str(p.relative_to(path)), p) for p in parts])}
    return {"size": path.stat().st_size, "sha256": _sha256(path)}


def _digest(named: List[Tuple[str, Path]]) -> str:
    """One SHA-256 of several files, each by its name and its bytes' SHA-256."""
    return hashlib.sha256(_canonical([[name, _sha256(path)] for name, path in named]).encode()).hexdigest()


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _crc(arrays: Dict[str, Any]) -> int:
    crc = 0
    for name in ARRAYS:
        crc = zlib.crc32(arrays[name].tobytes(), crc)
    return crc


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `path` (created) while the body runs; the system drops it if the process dies."""
    import fcntl

    with open(path, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _rows(counts: Dict[str, Any]) -> str:
    n = counts["rows"] + counts["skipped"]
    return f"{n} row{'' if n == 1 else 's'}"


def _version(name: str) -> Optional[str]:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))
