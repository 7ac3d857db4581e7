"""The reference's log-probabilities of every preference pair, computed once before training and kept with the
samples, so that no rank holds a second model (launcher/preference: the DPO step reads them from the batch).

The reference is the model as training starts: the weights checkpoint.init_from loaded (or the seed made), or,
for a peft model, that model with its adapters disabled (the base, as TRL's DPOTrainer takes it). Before the
first step, each data-parallel share of ranks computes the answers' per-token log-probabilities of its pairs
(pair k goes to share k mod shares; tensor-parallel ranks of a share compute together; every rank runs the same
number of forwards, the last ones padded), in eval mode (no dropout: the reference is one function) under the
recipe's autocast, and writes them to the run folder; then every rank reads them all and attaches them to its
dataset (`attach_reference`), whose items carry them from then on.

They are kept in `<run_dir>/reference/<key>/`, the key a digest of what the tokens were made from (the dataset's
`reference_key()`), of the reference weights' bytes (every parameter and buffer, gathered whole one at a
time where sharded, under names without the wrappers') and of the dtype the recipe's autocast computes in: a
resumed run, under this layout or another, reads the same values, and a run whose data, starting weights or
precision changed computes them again.

The folder holds a part per rank and `done.json`, written last by rank 0, naming each part with a digest of its
bytes and saying what they were computed from (`computed_from`: the data's digest, the weights', the precision):
a folder without it (a run killed during the pass), whose parts are not the bytes it names or not the tokens'
lengths (files damaged or truncated), or whose mark says another source (another run's folder copied here: its
name proves nothing) is computed again and said so, never read. Every rank agrees
on what it found before any rank writes, so that none computes while another has read."""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save
from torch import nn

from launcher.checkpoint import adapters
from launcher.data.device import to_device
from launcher.errors import UserError
from launcher.model.plain import unwrap
from launcher.model.step import logits_of
from launcher.preference import logps
from launcher.strategies import Strategy

FOLDER = "reference"
MARK = "done.json"  # written last: names the parts, each with a digest of its bytes, and what they were computed from
OTHER = "computed from other"  # why kept values are not read, where they are another source's
WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.", "module.")


def attach(step: Any, datasets: Dict[str, Any], model: nn.Module, strategy: Strategy, run_dir: Path,
           per_rank: int, collate: Callable, autocast: Callable, say: Callable[[str], None],
           elsewhere: Optional[Path] = None) -> None:
    """Give each preference dataset (`datasets`: key -> dataset) the reference's log-probabilities, unless the
    step needs none or they are attached already: those kept in this run folder, else those kept in `elsewhere`
    (the run folder of the checkpoint this run resumes), copied here, else computed now. Collective: every rank
    calls it alike."""
    if hasattr(step, "needs_reference") and strategy.name == "pp":
        raise UserError("parallel.pp: the preference step runs the whole model on both answers of each pair, and "
                        "pipeline stages run it piece by piece; set parallel.pp=1 (fsdp and tp split a model too)")
    if not getattr(step, "needs_reference", False):
        return
    weights = None
    for key, dataset in datasets.items():
        if dataset is None or getattr(dataset, "_launcher_reference", None):
            continue
        if not (getattr(dataset, "pairwise", False) and callable(getattr(dataset, "attach_reference", None))):
            raise UserError(f"{key}: step.loss_type {step.loss_type} needs the reference's log-probabilities of every "
                            f"pair, computed before training over a map-style preference dataset, and "
                            f"{type(dataset).__name__} holds none (a stream is read as it comes); use TextDataset with "
                            f"format: preference, or a reference-free step.loss_type: simpo")
        weights = weights or _digest(model)  # once for data.train and data.val: a pass over every weight
        source = {"data": hashlib.sha256(dataset.reference_key().encode()).hexdigest(), "weights": weights,
                  "precision": _computed_in(autocast)}
        made = f"{dataset.reference_key()}\n{weights}\n{source['precision']}"
        digest = hashlib.sha256(made.encode()).hexdigest()[:24]
        folder = run_dir / FOLDER / digest
        kept = elsewhere / FOLDER / digest if elsewhere is not None else None
        found = _attached(dataset, folder, source)
        if _everywhere(strategy, found):
            say(f"{key}: the reference's log-probabilities of {dataset.pairs()} pairs read from {folder}")
        elif kept is not None and kept != folder and _everywhere(strategy, _attached(dataset, kept, source)):
            strategy.agree(lambda: _written(folder, lambda: shutil.copytree(kept, folder, dirs_exist_ok=True))
                           if strategy.placement.is_main else None)
            say(f"{key}: the reference's log-probabilities of {dataset.pairs()} pairs read from {kept} (the resumed "
                f"run's), kept in {folder}")
        else:
            if found:  # said by rank 0 alone, as every line: what it found there
                what = "are not this run's" if OTHER in found else "are not whole"
                say(f"{key}: the reference's log-probabilities kept in {folder} {what} ({found}): computed again")
            _compute(step, dataset, model, strategy, folder, per_rank, collate, autocast, source)
            found = _attached(dataset, folder, source)
            if found is not None:  # every rank wrote its part and rank 0 the mark: a part unread is a bug
                raise RuntimeError(f"{folder}: the reference's log-probabilities just written do not read back: "
                                   f"{found or 'no done.json'}")
            say(f"{key}: the reference's log-probabilities of {dataset.pairs()} pairs computed once, kept in {folder}")
        dataset._launcher_reference = digest


def _everywhere(strategy: Strategy, found: Optional[str]) -> bool:
    """Whether every rank read and attached the values (`found` None on each). Collective: every rank learns it
    before any writes, so that none computes while another goes on."""
    return all(f is None for f in strategy.all_gather_object(found))


def kept_beside(resume: Any) -> Optional[Path]:
    """The run folder of a local checkpoint a run resumes (<run_dir>/checkpoints/step_N), where its reference is."""
    if resume is None or "://" in str(resume):
        return None
    path = Path(str(resume))
    return path.parent.parent if path.parent.name == "checkpoints" else None


def _compute(step: Any, dataset: Any, model: nn.Module, strategy: Strategy, folder: Path, per_rank: int,
             collate: Callable, autocast: Callable, source: Dict[str, str]) -> None:
    strategy.agree(lambda: _written(folder, lambda: _unmarked(folder)) if strategy.placement.is_main else None)
    shares, share = strategy.data_share()
    pairs = dataset.pairs()
    mine = list(range(share, pairs, shares))
    per_rank = max(1, per_rank)
    forwards = -(-(-(-pairs // shares)) // per_rank)  # the most any share needs: every rank runs as many
    found: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
    plain = unwrap(model)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), _adapters_off(plain):
            for f in range(forwards):
                taken = mine[f * per_rank:(f + 1) * per_rank]
                items = [dataset.pair_item(k) for k in (taken or [0])]  # a share with none left: pair 0, unkept
                batch = to_device(_collated(collate, items), strategy.device)
                with autocast():
                    output = model(**step.inputs(model, batch))
                values = logps.per_token(logits_of(output), batch["labels"]).double().cpu()
                for j, (k, item) in enumerate(zip(taken, items)):
                    found[k] = (values[2 * j, :len(item["chosen_labels"])].clone(),
                                values[2 * j + 1, :len(item["rejected_labels"])].clone())
    finally:
        model.train(was_training)
    name = f"part-{strategy.placement.rank}.safetensors"
    # agreed: a rank that cannot write (a full disk) stops every rank with its line, none waits for it
    digest = strategy.agree(lambda: _written(folder, lambda: _write_part(folder, name, found)))
    digests = strategy.all_gather_object((name, digest))  # after rank 0 removed the mark
    strategy.agree(lambda: _written(folder, lambda: _mark(folder, pairs, dict(digests), source))
                   if strategy.placement.is_main else None)


def _unmarked(folder: Path) -> None:
    """The folder made, and a mark left from before removed: it would name parts being rewritten."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MARK).unlink(missing_ok=True)


def _mark(folder: Path, pairs: int, parts: Dict[str, str], source: Dict[str, str]) -> None:
    temporary = folder / f"{MARK}.tmp"
    temporary.write_text(json.dumps({"pairs": pairs, "parts": parts, "computed_from": source}) + "\n")
    temporary.replace(folder / MARK)


def _written(folder: Path, write: Callable[[], Any]) -> Any:
    try:
        return write()
    except OSError as e:
        raise UserError(f"{folder}: the reference's log-probabilities cannot be written there: "
                        f"{e.strerror or type(e).__name__}; free space in the run folder, or move run_dir") from None


def _collated(collate: Callable, items: list) -> Dict[str, Any]:
    try:
        batch = collate(items)
    except (RuntimeError, TypeError, ValueError) as e:
        raise UserError(f"data.collate: pairs of answers need launcher.data.collate.Pairs, which pads both answers "
                        f"and numbers them ({type(e).__name__} from the recipe's collate)") from None
    if not isinstance(batch, dict) or "sequence_ids" not in batch:
        raise UserError("data.collate: pairs of answers need launcher.data.collate.Pairs, which pads both answers and "
                        "numbers them (sequence_ids)")
    return batch


def datasets_of(train_data: Any, val: Any) -> Dict[str, Any]:
    """The datasets a run reads (data.train, data.val), under the loaders' wrappers (item_rng.Seeded)."""
    train = getattr(train_data, "dataset", None) or getattr(getattr(train_data, "share", None), "dataset", None)
    held = getattr(val, "loader", None)
    return {"data.train": _inner(train), "data.val": _inner(getattr(held, "dataset", None))}


def _inner(dataset: Any) -> Any:
    while dataset is not None and not hasattr(dataset, "attach_reference") and hasattr(dataset, "dataset"):
        dataset = dataset.dataset
    return dataset


def _write_part(folder: Path, name: str, found: Dict[int, Tuple[torch.Tensor, torch.Tensor]]) -> str:
    """This rank's values written to `folder/name` (by a rename, whole or not at all); the digest of its bytes."""
    index = sorted(found)
    tensors = {"index": torch.tensor(index, dtype=torch.int64),
               "chosen_lengths": torch.tensor([len(found[k][0]) for k in index], dtype=torch.int64),
               "rejected_lengths": torch.tensor([len(found[k][1]) for k in index], dtype=torch.int64),
               "chosen": torch.cat([found[k][0] for k in index]) if index else torch.zeros(0, dtype=torch.float64),
               "rejected": torch.cat([found[k][1] for k in index]) if index else torch.zeros(0, dtype=torch.float64)}
    data = save(tensors)
    folder.mkdir(parents=True, exist_ok=True)
    temporary = folder / f"{name}.tmp"
    temporary.write_bytes(data)
    temporary.replace(folder / name)
    return _bytes_digest(data)


def _attached(dataset: Any, folder: Path, source: Dict[str, str]) -> Optional[str]:
    """None where the values kept in `folder` were read whole and attached to `dataset`; else why not: '' where
    nothing was kept there, or what is wrong with what was (OTHER in it where they were computed from another
    source than `source`)."""
    if not (folder / MARK).is_file():
        return ""
    try:
        values = _read(folder, dataset.pairs(), source)
        dataset.attach_reference(values)  # ValueError where a pair's values are not its tokens' lengths
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _read(folder: Path, pairs: int, source: Dict[str, str]) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Every pair's values from the parts that `folder`'s mark names, each checked against its digest, the mark's
    source against `source`; or OSError, ValueError, KeyError, TypeError, SafetensorError where they are not
    whole, or not of that source."""
    mark = json.loads((folder / MARK).read_text())
    if not isinstance(mark, dict) or mark.get("pairs") != pairs or not isinstance(mark.get("parts"), dict):
        raise ValueError(f"{MARK} is not that of {pairs} pairs' parts")
    kept = mark.get("computed_from")
    if kept != source:  # another run's folder copied here (its name is no proof: the mark says what it was of)
        other = [name for name in source if not isinstance(kept, dict) or kept.get(name) != source[name]]
        raise ValueError(f"{OTHER} {', '.join(other)} than this run's, says {MARK}")
    values: List[Optional[Tuple[torch.Tensor, torch.Tensor]]] = [None] * pairs
    for name, expected in mark["parts"].items():
        if Path(name).name != name or not name.startswith("part-"):
            raise ValueError(f"{MARK} names {name!r}, not a part of this folder")
        data = (folder / name).read_bytes()
        if _bytes_digest(data) != expected:
            raise ValueError(f"{name} is not the bytes written")
        t = load(data)
        for side in ("chosen", "rejected"):
            lengths, flat = t[f"{side}_lengths"], t[side]
            if (lengths.dtype != torch.int64 or lengths.dim() != 1 or flat.dim() != 1 or (lengths < 0).any()
                    or int(lengths.sum()) != len(flat)):
                raise ValueError(f"{name}: its {side} lengths do not cover its {flat.numel()} values")
        chosen = torch.split(t["chosen"].double(), t["chosen_lengths"].tolist())
        rejected = torch.split(t["rejected"].double(), t["rejected_lengths"].tolist())
        for k, c, r in zip(t["index"].tolist(), chosen, rejected, strict=True):
            if not 0 <= k < pairs:
                raise ValueError(f"{name} holds pair {k} of {pairs}")
            values[k] = (c, r)
    missing = sum(v is None for v in values)
    if missing:
        raise ValueError(f"{missing} of {pairs} pairs in no part")
    return values  # type: ignore[return-value]


def _computed_in(autocast: Callable) -> str:
    """The dtype the recipe's autocast computes in (none: the weights' own): a run resumed under another precision
    computes the reference again, as a run started under it would."""
    return str(getattr(autocast(), "fast_dtype", None))


def _bytes_digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _digest(model: nn.Module) -> str:
    """The reference weights' bytes, digested: every parameter and buffer by its plain name (adapters left out:
    the reference runs without them), a sharded one gathered whole (collective, in the same order on every rank)."""
    h = hashlib.blake2b(digest_size=16)
    plain = unwrap(model)
    named = dict(plain.named_parameters())
    named.update(dict(plain.named_buffers()))
    for name in sorted(named, key=_plain_name):
        if adapters.is_adapter_key(name):
            continue
        tensor = named[name].detach()
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        h.update(f"{_plain_name(name)} {tensor.dtype} {tuple(tensor.shape)}\n".encode())
        h.update(tensor.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())  # 0-d too (a scale buffer)
    return h.hexdigest()


def _plain_name(name: str) -> str:
    for wrapper in WRAPPERS:
        name = name.replace(wrapper, "")
    return name


def _adapters_off(plain: nn.Module):
    """A peft model without its adapters (the base it adapts); anything else as it is."""
    off = getattr(plain, "disable_adapter", None)
    return off() if callable(off) and hasattr(plain, "peft_config") else contextlib.nullcontext()
