"""A stream's share: what one rank of W reads of a `torch.utils.data.IterableDataset` (HF `datasets` in
streaming mode, WebDataset, a generator over files), and what each of its loader workers hands out, in
batches, from a place it can be resumed at (launcher/data/stream.py makes the loaders).

Which items a rank takes. A global batch is `data.batch_size` consecutive items of the stream, whatever
the world size; rank r of W takes the items r, r+W, r+2W, ... of each (DistributedSampler's
interleaving, applied batch by batch), so a rank's batches are the same global batches' shares at any
world size. An HF `datasets.IterableDataset` is split by its own hook instead
(`datasets.distributed.split_dataset_by_node`: whole files per rank where they divide evenly), so each
rank reads only its own part; its global batches then depend on the world size.

Validation. Every item once, in one process's global batches, the last one incomplete; as many batches
on every rank, which each knows without a collective, having read the whole stream (an HF stream too
is interleaved here, not split by its hook): `Share._last`.

Workers. Worker w of K takes the rank's batches w, w+K, ... counted from where the loader started, so
the DataLoader's round robin hands them out in the stream's order. Each worker reads the rank's
whole share and collates only its own batches: K workers read the stream K times and share the
collating. A rank's stream never ends: at its end the next epoch starts (`set_epoch(epoch)` when the
dataset has it); a last, incomplete global batch is dropped.

Resume. Every batch carries the place it leaves the stream at: the epoch, the items read of it, the
batches handed out, and the dataset's own `state_dict()` where it has one (HF datasets do). A
checkpoint keeps, for each rank, the place of its last batch. A resumed dataset with state loads it
and reads on from there; one without is read again from the epoch's start and the items each rank
consumed are skipped (one line says so). At another world size, the interleaved share is read
again from the last whole global batch (one line); a stream split by its own hook cannot move
between world sizes and is refused with one line.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any, Callable, Dict, Iterator, List, Optional

from launcher.data import item_rng
from launcher.errors import UserError


def is_hf_stream(dataset: Any) -> bool:
    return type(dataset).__module__.startswith("datasets.") and type(dataset).__name__ == "IterableDataset"


def _copy(dataset: Any) -> Any:
    """A copy to read from, or the dataset itself where it cannot be copied (an open file, a lock)."""
    try:
        return copy.deepcopy(dataset)
    except Exception:
        return dataset


def _stateful(dataset: Any) -> bool:
    return callable(getattr(dataset, "state_dict", None)) and callable(getattr(dataset, "load_state_dict", None))


class Share:
    """What one rank reads of a stream: its items of each epoch, in order, and where it stands."""

    def __init__(self, dataset: Any, key: str, batch_size: int, replicas: int, rank: int, drop_last: bool = True,
                 seed: int = 0):
        self.key, self.replicas, self.rank, self.drop_last, self.seed = key, replicas, rank, drop_last, seed
        self.epoch_of_keys = -1 if key == "data.val" else None  # validation's items: an epoch of their own
        self.per_rank = max(batch_size // replicas, 1)
        self.global_batch = self.per_rank * replicas
        # validation (no drop_last) is interleaved: each rank counts the whole stream, so the others' batches (_last)
        self.own_split = is_hf_stream(dataset) and replicas > 1 and drop_last
        if self.own_split:
            from datasets.distributed import split_dataset_by_node

            dataset = split_dataset_by_node(dataset, rank=rank, world_size=replicas)
        self.dataset = dataset
        self.stateful = _stateful(dataset)

    def _epoch_items(self, dataset: Any, epoch: int) -> Iterator[Any]:
        """The dataset's items of one epoch (all of them; the rank's share is taken by the caller)."""
        set_epoch = getattr(dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        if is_hf_stream(dataset):  # read as in the main process even in a worker: the share is ours to take
            for row in dataset.iter(batch_size=1):
                yield {k: v[0] for k, v in row.items()}
        else:
            yield from dataset

    def _read(self, dataset: Any, epoch: int, start: int, counted_from: int) -> Iterator[tuple]:
        """(index, item) of the epoch's items from `start` on, each made under the seed of its index in
        the epoch (launcher/data/item_rng.py); the iterator's first item is item `counted_from` (0: from the
        start, the ones before `start` made and dropped)."""
        items = iter(self._epoch_items(dataset, epoch))
        epoch_key = epoch if self.epoch_of_keys is None else self.epoch_of_keys
        for i in itertools.count(counted_from):
            item_rng.seed(item_rng.key(self.seed, epoch_key, i))
            try:
                item = next(items)
            except StopIteration:
                return
            if i >= start:
                yield i, item

    def _collated(self, group: List[Any], epoch: int, first: int, collate: Callable) -> Any:
        epoch_key = epoch if self.epoch_of_keys is None else self.epoch_of_keys
        item_rng.seed(item_rng.key(self.seed, epoch_key, first) ^ item_rng.COLLATE)
        return collate(group)

    def _mine(self, index: int) -> bool:
        """Whether the epoch's item `index` is this rank's (streams split by their own hook: all are)."""
        if self.own_split or self.replicas == 1:
            return True
        return (index % self.global_batch) % self.replicas == self.rank

    def _ends_batch(self, index: int, group: List[Any]) -> bool:
        """Whether the epoch's item `index` completes a global batch. An interleaved rank waits for the batch's
        last item, whoever's it is: the epoch's last, incomplete global batch is then dropped by every rank alike,
        where a rank whose share of it was whole would otherwise run it alone."""
        if self.own_split or self.replicas == 1:
            return len(group) == self.per_rank
        return (index + 1) % self.global_batch == 0

    def batches(self, start: Dict[str, Any], worker: int, workers: int, collate: Callable) -> Iterator[tuple]:
        """(place after the batch, collated batch) for this worker's batches, from `start` on, endlessly.

        `start` is a place: {epoch, index (items of the epoch read), batch (global batches of the epoch
        done), batches (of the run), dataset (its state_dict, or None to skip `index` items)}."""
        # HF keeps its epoch in memory shared with the loader's workers: each reader gets its own copy
        dataset = copy.deepcopy(self.dataset) if is_hf_stream(self.dataset) else self.dataset
        epoch, index, in_epoch, number = start["epoch"], start["index"], start["batch"], start["batches"]
        first = number
        state = start.get("dataset")
        kept = item_rng.Kept()  # the process's generators, given back while the batch is away
        while True:
            if state is not None:
                dataset.load_state_dict(state)  # read on from there: its items are counted from `index`
                items = self._read(dataset, epoch, index, index)
            else:
                items = self._read(dataset, epoch, index, 0)
            state, group, handed, group_start, read = None, [], 0, None, None
            for i, item in items:
                read = (i, item)  # the epoch's last item read so far, whoever's
                if self._mine(i):
                    group_start = i if not group else group_start
                    group.append(item)
                if not self._ends_batch(i, group):
                    continue
                if len(group) < self.per_rank:  # begun before a resume from a rank's own place (an older checkpoint)
                    group = []
                    continue
                in_epoch += 1
                if (number - first) % workers == worker:
                    place = {"epoch": epoch, "index": i + 1, "batch": in_epoch, "batches": number + 1,
                             "split": "own" if self.own_split else "ours",
                             "dataset": dataset.state_dict() if self.stateful else None}
                    batch = self._collated(group, epoch, group_start, collate)
                    kept.back()
                    yield place, batch
                    kept = item_rng.Kept()
                number, group, handed = number + 1, [], handed + 1
            if not self.drop_last:
                last = self._last(group, group_start, read)
                if last is not None and (number - first) % workers == worker:
                    place, group, group_start = last
                    batch = self._collated(group, epoch, group_start, collate)
                    kept.back()
                    yield place, batch
                else:
                    kept.back()
                return
            if handed == 0 and in_epoch == 0:
                raise UserError(f"{self.key}: the stream's epoch {epoch} holds fewer items than one batch "
                                f"(data.batch_size {self.global_batch})")
            epoch, index, in_epoch = epoch + 1, 0, 0

    def _last(self, group: List[Any], group_start: Optional[int], read: Optional[tuple]) -> Optional[tuple]:
        """(place, items, index of the first) of validation's last batch on this rank, where it has one.

        Every rank runs as many: a sharded model's forward is collective (fsdp's all-gathers, ep's all-to-alls),
        and a rank with a batch fewer left the others waiting in their last forward until dist_timeout. Rank 0's
        share of an incomplete last global batch is never empty; a rank whose share is runs the item it read
        last alone, marked PADDING: run, never counted (launcher/run/metrics.py evaluate), as ShardSampler's."""
        if group:
            return None, group, group_start
        if self.replicas > 1 and read is not None and (read[0] + 1) % self.global_batch:
            return PADDING, [read[1]], read[0]
        return None

    def first_items(self) -> List[Any]:
        """This rank's items of the first global batch, from a fresh pass (for the check before training).
        Every rank reads the whole first global batch, so a stream shorter than one fails on every rank."""
        dataset = _copy(self.dataset)  # so that training reads the same dataset as it was, untouched
        size = self.per_rank if self.own_split else self.global_batch
        kept = item_rng.Kept()  # the check leaves the process's generators as they were
        try:
            read = list(itertools.islice(self._read(dataset, 0, 0, 0), size))
        finally:
            kept.back()
        if len(read) < size:
            raise UserError(f"{self.key}: the stream ends after {len(read)} items, fewer than one batch "
                            f"(data.batch_size {self.global_batch}"
                            f"{f' over {self.replicas} processes' if self.replicas > 1 else ''})")
        return [item for i, item in read if self._mine(i)]

    def joined_place(self, theirs: Dict[str, Any]) -> Dict[str, Any]:
        """This rank's place where another rank of the same world stands at `theirs` (the same global batches
        done). An interleaved share's place is every rank's: each reads the whole stream. A stream split by its own
        hook is each rank's own part: read again from the epoch's start, the rank's items of the batches done
        skipped."""
        if not self.own_split:
            return theirs
        return {**theirs, "index": theirs["batch"] * self.per_rank, "dataset": None}

    def resume_place(self, saved: List[Dict[str, Any]], saved_world: int) -> tuple:
        """(this rank's start place, a line for the console or None) from a checkpoint's places."""
        mine = saved[self.rank] if saved_world == self.replicas and self.rank < len(saved) else None
        if mine is not None:
            if mine["dataset"] is not None and self.stateful:
                return mine, None
            return {**mine, "index": mine["batch"] * (self.per_rank if self.own_split else self.global_batch),
                    "dataset": None}, (
                f"{self.key}: {type(self.dataset).__name__} has no state_dict(); its stream is read again from the "
                f"start of epoch {mine['epoch']} and the {mine['batch']} batches done are skipped")
        if self.own_split or (saved and saved[0].get("split") == "own"):
            raise UserError(f"checkpoint.resume: the checkpoint's stream was split by its own hook over {saved_world} "
                            f"processes and cannot be resumed by {self.replicas}; resume with {saved_world}, or start "
                            f"over with checkpoint.resume=never")
        first = saved[0]  # every rank finished the same global batches
        return {**first, "index": first["batch"] * self.global_batch, "dataset": None}, (
            f"{self.key}: the stream was read by {saved_world} processes; {self.replicas} read it again from the start "
            f"of epoch {first['epoch']}, skipping its {first['batch']} global batches done")


START = {"epoch": 0, "index": 0, "batch": 0, "batches": 0, "dataset": None}
PADDING = "padding"  # the place of a validation batch run only to meet the other ranks' collectives (Share._last)
