"""A checkpoint's manifest.json: written last, it lists each file's size and CRC-32 (in an object store, the
store's ETag too). A step folder with a readable manifest is complete (the save finished); its files matching
the manifest make it undamaged."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Dict, Optional

from launcher.checkpoint import files, storage
from launcher.errors import UserError, shown

NAME = "manifest.json"


def write(folder: Path, step: int, listed: Dict[str, Any], **about: Any) -> None:
    """The manifest of a checkpoint whose files are all written (format 3: sharded, 2: full state); in an
    object store each entry with its object's ETag too."""
    if storage.is_remote(folder):
        listed = _with_etags(folder, listed)
    manifest = {"format": 3 if about.get("sharded") else 2, "step": step, **about, "files": listed, "time": time.time()}
    data = json.dumps(manifest, indent=1).encode()
    if storage.is_remote(folder):
        (folder / NAME).write_bytes(data)  # one request: an object is stored whole or not at all
    else:
        files.write(folder / NAME, lambda f: f.write(data))


def read(folder: Path) -> Optional[Dict[str, Any]]:
    """The files a checkpoint's manifest lists, {name: entry}, or None where it has no readable one."""
    try:
        listed = json.loads((folder / NAME).read_text())["files"]
        return listed if isinstance(listed, dict) and all(isinstance(e, (int, dict)) and "size" in _entry(e)
                                                          for e in listed.values()) else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def is_complete(folder: Path) -> bool:
    """The manifest is there and lists the checkpoint's files: it is written last, so the save finished
    (whether its files are still as written is verify()'s question)."""
    return read(folder) is not None


def verified(folder: Path) -> None:
    """A checkpoint folder whose save finished and whose files match their manifest entries, or one line."""
    if not is_complete(folder):
        raise UserError(f"{folder}: not a complete checkpoint (no valid manifest.json); name a step_<N> folder that "
                        f"has one")
    problem = verify(folder)
    if problem is not None:
        raise UserError(f"{folder}: damaged ({problem}); use another checkpoint")


def _entry(entry: Any) -> Dict[str, Any]:
    return {"size": entry} if isinstance(entry, int) else entry  # format 1 manifests listed sizes alone


def verify(folder: Path) -> Optional[str]:
    """What is wrong with a complete checkpoint's files (a file missing, of another size or with another
    CRC-32 than the manifest lists), naming the file (the manifest's text, shown escaped), or None. Checkpoints
    written before checksums were recorded pass on their sizes alone. In an object store, one listing gives every
    object's size and ETag: an object whose ETag is the one recorded when the checkpoint was sealed is that object,
    unchanged, and is not downloaded to be checked (the reader downloads it once); any other is, and its CRC-32
    decides."""
    stored = folder.listing() if storage.is_remote(folder) else None
    for name, entry in (read(folder) or {}).items():
        try:
            size = storage.size(folder / name) if stored is None else stored[name]["size"]
        except KeyError:
            return f"{shown(name)}: no such object, the manifest lists it"
        except OSError as e:
            return f"{shown(name)}: {e.strerror or shown(e)}, the manifest lists it"
        if size != _entry(entry)["size"]:
            return f"{shown(name)}: {size} bytes, the manifest says {shown(_entry(entry)['size'], 40)}"
        if stored is not None and _sealed(stored[name], entry):
            continue
        problem = _crc_problem(folder / name, entry)
        if problem:
            return problem
    return None


def _sealed(stored: Dict[str, Any], entry: Any) -> bool:
    """An object the store lists with the ETag recorded in its manifest entry."""
    etag = _entry(entry).get("etag")
    return etag is not None and stored.get("etag") == etag


def _with_etags(folder: Path, listed: Dict[str, Any]) -> Dict[str, Any]:
    """The manifest entries of an object store's checkpoint, each with the ETag the store gives its object
    (one listing), where it has one and its size is the entry's."""
    stored = folder.listing()
    out = {}
    for name, entry in listed.items():
        entry, found = dict(_entry(entry)), stored.get(name, {})
        if found.get("etag") and found.get("size") == entry["size"]:
            entry["etag"] = found["etag"]
        out[name] = entry
    return out


def _crc_problem(path: Path, entry: Any) -> Optional[str]:
    """How the file's CRC-32 differs from its manifest entry's, or None (also for an entry without one)."""
    want = _entry(entry).get("crc32")
    got = files.crc32(path) if want is not None else want
    return None if got == want else f"{shown(path.name)}: CRC-32 {got}, the manifest says {shown(want, 40)}"


def check_file(path: Path) -> None:
    """A file inside a checkpoint folder is checked against that folder's manifest before it is used."""
    listed = read(path.parent) if path.is_file() else None
    entry = listed.get(path.name) if listed else None
    if entry is not None and storage.is_remote(path) and _sealed(path.parent.listing().get(path.name, {}), entry):
        return
    if entry is not None and _crc_problem(path, entry):
        raise UserError(f"{path}: damaged: its CRC-32 differs from the one {path.parent / NAME} recorded; use another "
                        f"checkpoint's file")
