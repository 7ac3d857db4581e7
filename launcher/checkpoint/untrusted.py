"""What a model folder holds, read as untrusted input: a safetensors file's header and the folder's JSON
(its index, config.json), each checked before anything they describe is allocated or read. A problem is
one line naming the file (UserError). The JSON reader itself is launcher/jsonfile.py, a leaf that the data
path's tokenizer reads its folder with too; `json_file` is here as the checkpoint package has always named it.

A header is validated by the safetensors library itself, through `safe_open` (its Rust parser; the file is
memory-mapped, nothing is read but the header): JSON within its recursion limit; a dtype it knows; a shape
and data_offsets of non-negative integers; a size that does not overflow; data_offsets that tile the data
section in order, without gap or overlap, and cover it whole; a header of at most 100 MB. The launcher keeps
its own reader (plain reads of a slice's rows, straight into a shard), whose offsets are those the library
accepted. One bound is the launcher's own, checked before the library parses anything: a header may not
declare more tensors than its data section can hold, so that a small file cannot make a parser build
millions of entries (the library takes about 1 KB of memory for each)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Tuple

import torch

from launcher.errors import UserError, first_line, short, shown
from launcher.jsonfile import MAX_JSON, json_file  # noqa: F401 - read here by hf.py and export

# the library's dtype names and torch's: all it has but the sub-byte F4 and F6 (torch packs those in pairs)
_TORCH = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
          "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu", "F8_E4M3FNUZ": "float8_e4m3fnuz",
          "F8_E5M2FNUZ": "float8_e5m2fnuz", "C64": "complex64", "I64": "int64", "I32": "int32", "I16": "int16",
          "I8": "int8", "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool"}
DTYPES = {name: getattr(torch, kind) for name, kind in _TORCH.items() if hasattr(torch, kind)}  # as this torch has them
MAX_HEADER = 100_000_000  # the library's cap on a header (its MAX_HEADER_SIZE): refused before we read it
EMPTY_ALLOWED = 10_000  # tensors of no elements take no bytes of data: so many are allowed beyond its bytes


def header(path: Path) -> Tuple[List[Tuple[str, torch.dtype, torch.Size, int]], int]:
    """A safetensors file's tensors in the order of their data, each (name, dtype, shape, where its bytes
    begin in the data section), and where its data section begins in the file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        # The library's own rules on the length (its HeaderTooLarge, InvalidHeaderLength), applied before
        # the header is read: the library would refuse it.
        if size < 8:
            raise UserError(f"{path}: not a safetensors file: {size} bytes, fewer than the 8 that give its header's "
                            f"length")
        if length > min(MAX_HEADER, size - 8):
            raise UserError(f"{path}: not a safetensors file: its first 8 bytes give a header of {length:,} bytes, "
                            f"in a file of {size:,} (a header takes at most {MAX_HEADER:,} bytes, within the file)")
        # Every tensor's shape and data_offsets are JSON arrays: the header declares at most half as many
        # tensors as it has '[' (counted a MB at a time). Each takes a byte of data at least, bar those of
        # no elements.
        brackets, left = 0, length
        while left:
            chunk = f.read(min(left, 1 << 20))
            if not chunk:
                break
            brackets, left = brackets + chunk.count(b"["), left - len(chunk)
    data, most = size - 8 - length, brackets // 2
    if most > data + EMPTY_ALLOWED:
        raise UserError(f"{path}: not a safetensors file of weights: its header of {length:,} bytes has room for "
                        f"{most:,} tensors, and its {data:,} bytes of data hold {data + EMPTY_ALLOWED:,} at most "
                        f"(a tensor takes a byte at least, bar {EMPTY_ALLOWED:,} empty ones)")
    return _validated(path), 8 + length


def _validated(path: Path) -> List[Tuple[str, torch.dtype, torch.Size, int]]:
    try:
        from safetensors import SafetensorError, safe_open
    except ImportError:
        raise UserError(f"{path}: reading a .safetensors file needs the safetensors package, which validates its "
                        f"header: pip install 'launcher[export]' (or pip install safetensors)") from None
    try:
        with safe_open(str(path), framework="pt") as f:
            entries = [(name, f.get_slice(name)) for name in f.offset_keys()]
            entries = [(name, part.get_dtype(), part.get_shape()) for name, part in entries]
    except SafetensorError as e:
        problem = shown(first_line(e).replace("Error while deserializing header: ", ""), 300)  # may quote a name
        raise UserError(f"{path}: not a valid safetensors file: {problem} (a safetensors header gives each tensor a "
                        f"dtype, a shape of non-negative integers and data_offsets [begin, end] that tile the data "
                        f"after it in order, whole, without gap or overlap)") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read it: {e.strerror or e}") from None
    # The library has checked that the tensors, in this order, tile the data from its start, each taking
    # what its shape and dtype take: each one's offset is the sum of those before it.
    out, begin = [], 0
    for name, dtype, shape in entries:
        if dtype not in DTYPES:
            raise UserError(f"{path}: {short(name)} is stored as {dtype}, which the launcher does not read (it reads "
                            f"{', '.join(DTYPES)}); convert the file's tensors to one of those")
        if any(n >= 2 ** 63 for n in shape):
            raise UserError(f"{path}: {short(name)} has the shape {shape}, whose dimensions torch cannot hold (at most "
                            f"2**63 - 1 each)")
        out.append((name, DTYPES[dtype], torch.Size(shape), begin))
        begin += out[-1][2].numel() * DTYPES[dtype].itemsize
    return out
