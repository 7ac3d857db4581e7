"""The HF format: a model folder as `save_pretrained` writes it, read for checkpoint.init_from and export,
and written by export --format hf for `from_pretrained`.

    <folder>/config.json                        the model's config (what from_pretrained builds from)
    <folder>/model.safetensors                  the weights, or:
    <folder>/model-0000N-of-0000M.safetensors   shards, and
    <folder>/model.safetensors.index.json       which shard holds each tensor

Nothing in such a folder runs: safetensors holds tensors alone, and config.json is read as JSON; headers,
the index and config.json are checked as untrusted input first (untrusted.py). Tensors
are read one at a time (Slice: plain reads at their offsets, a rank's rows alone where it asks for
them), in the dtype they were saved in (a bf16 folder is cast to the model's dtype tensor by tensor as it
is loaded)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Iterator, Mapping, Optional, Sequence, Tuple

import torch

from launcher.checkpoint import files, untrusted
from launcher.errors import UserError, short

NAME = "HF model folder"
SINGLE, INDEX, CONFIG = "model.safetensors", "model.safetensors.index.json", "config.json"
RUN_CONFIG = "hf_config.json"  # where a run of an HF model keeps its config, in the run folder


def holds(folder: Path) -> bool:
    return (folder / CONFIG).is_file() and ((folder / SINGLE).is_file() or (folder / INDEX).is_file())


def model_weights(folder: Path) -> Dict[str, torch.Tensor]:
    return {name: part.read() for name, part in slices(folder).items()}


def lazy_weights(folder: Path) -> "Tensors":
    return Tensors.sliced(slices(folder))


class Slice:
    """One tensor of a safetensors file, read only where asked: `shape`, and `read(index)` for the rows a
    rank's shard holds. Read with plain file reads rather than through a memory map, whose touched pages
    would count in the process's resident memory as long as the file is open. Made from a header that the
    safetensors library has validated (untrusted.header)."""

    def __init__(self, path: Path, name: str, dtype: torch.dtype, shape: torch.Size, start: int):
        self.path, self.name, self.dtype, self.shape, self.start = path, name, dtype, shape, start

    def read(self, index: Tuple[slice, ...] = (), into: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The tensor, or its part at `index` (slices; the first one's rows alone are read), read straight
        into `into` where that is a contiguous tensor of its dtype and the rows are whole, else copied there."""
        if not self.shape:
            rows, rest = slice(None), ()
        else:
            rows, rest = (index[0], index[1:]) if index else (slice(0, self.shape[0]), ())
        first, last, _ = rows.indices(self.shape[0]) if self.shape else (0, 1, 1)
        shape = ((max(last - first, 0),) + tuple(self.shape[1:])) if self.shape else ()
        whole_rows = all(r.indices(n) == (0, n, 1) for r, n in zip(rest, self.shape[1:]))
        direct = (into is not None and into.dtype == self.dtype and into.is_contiguous() and whole_rows
                  and tuple(into.shape) == shape)
        out = into if direct else torch.empty(shape, dtype=self.dtype)
        row = self.shape[1:].numel() * self.dtype.itemsize if self.shape else self.dtype.itemsize
        with open(self.path, "rb") as f:
            f.seek(self.start + first * row)
            got = f.readinto(out.view(-1).view(torch.uint8).numpy()) if out.numel() else 0
        if got != out.numel() * self.dtype.itemsize:
            raise UserError(f"{self.path}: ends inside {short(self.name)} (truncated?)")
        part = out[(slice(None),) + tuple(rest)] if rest and not whole_rows else out
        if into is not None and not direct:
            into.copy_(part.reshape(into.shape))
        return part


def slices(path: Path) -> Dict[str, Slice]:
    """Every tensor of an HF folder or a .safetensors file as a Slice (headers read and validated, no tensor
    yet). Every file of a folder is checked, and all their problems are said at once."""
    out: Dict[str, Slice] = {}
    problems = []
    for file, names in (_files(path) if path.is_dir() else {path: None}).items():
        try:
            found = _file_slices(file)
        except UserError as e:
            problems += e.problems
            continue
        for name in names if names is not None else found:
            if name not in found:
                problems.append(f"{file}: the index names {short(name)} in it, which it does not hold")
            else:
                out[name] = found[name]
    if problems:
        raise UserError(*problems)
    return out


def _file_slices(file: Path) -> Dict[str, Slice]:
    files.file_or_folder(file)
    if not file.is_file():
        raise UserError(f"{file}: no such file")
    entries, data_start = untrusted.header(file)
    return {name: Slice(file, name, dtype, shape, data_start + begin) for name, dtype, shape, begin in entries}


def safetensors_file(path: Path) -> Dict[str, torch.Tensor]:
    """All tensors of one .safetensors file."""
    return {name: part.read() for name, part in slices(path).items()}


def config(folder: Path) -> Optional[dict]:
    """The folder's config.json as a dict, or None without one."""
    path = folder / CONFIG
    if not path.is_file():
        return None
    return untrusted.json_file(path, "config")


def named_configs(spec: Any, key: str) -> None:
    """The config.json of each local folder that a recipe section names as `pretrained_model_name_or_path`,
    checked before transformers reads it (AutoConfig.from_pretrained parses it with Python's json, where a
    file nested too deep is a RecursionError)."""
    for where, value in named_folders(spec, key):
        if isinstance(value, str) and (Path(value) / CONFIG).is_file():
            try:
                untrusted.json_file(Path(value) / CONFIG, "config")
            except UserError as e:
                raise UserError(*(f"{where}: {p}" for p in e.problems)) from None


def named_folders(spec: Any, key: str) -> Iterator[Tuple[str, Any]]:
    """(its key, its value) of every `pretrained_model_name_or_path` in a recipe section, outermost first."""
    if isinstance(spec, Mapping):
        for name, value in spec.items():
            if name == "pretrained_model_name_or_path":
                yield f"{key}.{name}", value
            yield from named_folders(value, f"{key}.{name}")
    elif isinstance(spec, Sequence) and not isinstance(spec, str):
        for i, value in enumerate(spec):
            yield from named_folders(value, f"{key}[{i}]")


def _files(folder: Path) -> Dict[Path, Optional[list]]:
    """The folder's safetensors files, each with the tensor names the index gives it (None: all of them)."""
    if (folder / SINGLE).is_file():
        return {folder / SINGLE: None}
    index = folder / INDEX
    weight_map = untrusted.json_file(index, "safetensors index").get("weight_map")
    if not (isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())):
        raise UserError(f"{index}: not a safetensors index (a JSON object with a weight_map of tensor names to "
                        f"files)")
    out: Dict[Path, list] = {}
    for name, file in weight_map.items():
        if Path(file).name != file:
            raise UserError(f"{index}: names {short(file)} for {short(name)}; a shard is a file in the same folder")
        out.setdefault(folder / file, []).append(name)
    return out


def config_of(model) -> Optional[dict]:
    """An HF model's config as config.json holds it (with its class in `architectures`, as save_pretrained
    writes it), or None for a model without one."""
    cfg = getattr(model, "config", None)
    to_json = getattr(cfg, "to_json_string", None)
    if not callable(to_json):
        return None
    try:
        out = json.loads(to_json(use_diff=False))
    except (TypeError, ValueError):
        return None
    out["architectures"] = out.get("architectures") or [type(model).__name__]
    return out


def keep_config(run_dir: Path, cfg: dict) -> None:
    """What export --format hf writes beside the weights (rank 0, once a run has built its model)."""
    files.write_text(run_dir / RUN_CONFIG, json.dumps(cfg, indent=2, sort_keys=True) + "\n")


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
JSON_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class Tensors:
    """Tensors to write, read a shard at a time: `specs` (name -> shape and dtype, known before any is read)
    and `read(names)` (those tensors)."""

    def __init__(self, specs: Dict[str, Tuple[torch.Size, torch.dtype]], read):
        self.specs, self.read = specs, read

    @classmethod
    def of(cls, state: Dict[str, torch.Tensor]) -> "Tensors":
        return cls({k: (v.shape, v.dtype) for k, v in state.items()}, lambda names: {n: state[n] for n in names})

    @classmethod
    def sliced(cls, found: Dict[str, Slice]) -> "Tensors":
        return cls({k: (v.shape, v.dtype) for k, v in found.items()}, lambda names: {n: found[n].read() for n in names})


def write(out: Path, tensors, cfg: dict, dtype: Optional[torch.dtype], max_shard_bytes: int,
          replace: bool = False, beside: Optional[Mapping[str, bytes]] = None) -> list:
    """An HF model folder at `out` (new, or empty; with `replace`, one this wrote before): config.json, and
    the floating-point tensors (a state_dict, or Tensors read a shard at a time: no more than one shard's
    tensors are held) in `dtype` (None: as they are) as safetensors files of at most `max_shard_bytes`
    each (one tensor larger than that is a shard alone), with the index when there are several, keyed and
    split as save_pretrained writes them (a mixture of experts' fused weights per expert: hf_layout.py), and the
    files `beside` (a name in the folder -> its bytes: a tokenizer's, hf_tokenizer.py). Written in a hidden folder
    beside it, then renamed, so that `out` is whole or absent. Returns the files."""
    import shutil

    from safetensors.torch import save_file

    from launcher.checkpoint import hf_layout

    tensors = hf_layout.as_published(tensors if isinstance(tensors, Tensors) else Tensors.of(tensors), cfg)
    if replace and out.is_dir() and holds(out):
        shutil.rmtree(out)
    cast = {k: (dtype if dtype is not None and d.is_floating_point else d) for k, (_, d) in tensors.specs.items()}
    sizes = {k: shape.numel() * cast[k].itemsize for k, (shape, _) in tensors.specs.items()}
    shards = _shards(sizes, max_shard_bytes)
    names = [SINGLE] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                                                for i in range(len(shards))]

    def fill(partial: Path) -> list:
        for name, keys in zip(names, shards):
            save_file(unshared({k: v.to(cast[k]) for k, v in tensors.read(keys).items()}), str(partial / name),
                      metadata={"format": "pt"})
        written = list(names)
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(sizes.values())},
                     "weight_map": {k: name for name, keys in zip(names, shards) for k in keys}}
            files.write_text(partial / INDEX, json.dumps(index, indent=2, sort_keys=True) + "\n")
            written.append(INDEX)
        saved_as = dtype or next((d for d in cast.values() if d.is_floating_point), torch.float32)
        config = {**cfg, "dtype": JSON_DTYPES.get(saved_as, str(saved_as).replace("torch.", ""))}
        config.pop("torch_dtype", None)
        files.write_text(partial / CONFIG, json.dumps(config, indent=2, sort_keys=True) + "\n")
        for name, raw in (beside or {}).items():
            (partial / name).parent.mkdir(parents=True, exist_ok=True)
            (partial / name).write_bytes(raw)
        return written + [CONFIG] + list(beside or {})

    return files.write_folder(out, fill, "the HF model")


def unshared(part: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Tied tensors share memory, which safetensors refuses in one file: each later alias becomes a copy of
    its own, so every key is in the file and loads with strict=True (the model ties them again)."""
    seen, out = set(), {}
    for k, v in part.items():
        where = (v.untyped_storage().data_ptr(), v.storage_offset())
        out[k] = v.clone().contiguous() if where in seen else v.contiguous()
        seen.add(where)
    return out


def _shards(sizes: Dict[str, int], max_bytes: int) -> list:
    """The tensor names of each shard, in order, each shard at most `max_bytes` (save_pretrained's split)."""
    shards, size = [[]], 0
    for key, nbytes in sizes.items():
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    return shards
