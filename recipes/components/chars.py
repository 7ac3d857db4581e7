"""Character-level text as a map-style dataset of fixed-length windows, for next-character prediction."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import Dataset

ROOT = Path(__file__).resolve().parents[2]  # the repository: the folder that holds recipes/


class CharText(Dataset):
    """Non-overlapping windows of a UTF-8 text file, one character per token.

    The vocabulary is the sorted set of characters of the whole file, so the train and
    val splits of one file share it; `vocab_size` is its size (a recipe's model must
    have at least that many embeddings). The first `1 - val_fraction` of the text is
    `split="train"`, the rest `split="val"`. Item i is (x, y): x the `block_size`
    characters from i * block_size on, y the same window shifted one character on,
    both LongTensors. Only complete windows count.

    A relative `path` that does not exist from the working directory is taken relative
    to the repository root, so recipes name files such as recipes/data/hamlet.txt and
    run from anywhere.
    """

    def __init__(self, path: str, block_size: int, split: str = "train", val_fraction: float = 0.1):
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        if block_size < 1:
            raise ValueError(f"block_size must be 1 or more, got {block_size}")
        file = Path(path)
        if not file.is_absolute() and not file.exists():
            file = ROOT / file
        text = file.read_text(encoding="utf-8")
        self.chars = sorted(set(text))
        self.vocab_size = len(self.chars)
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        dtype = torch.uint8 if self.vocab_size <= 256 else torch.int64
        data = torch.tensor([self.stoi[c] for c in text], dtype=dtype)
        cut = int(len(data) * (1.0 - val_fraction))
        self.data = data[:cut] if split == "train" else data[cut:]
        self.block_size = block_size
        # A window needs block_size + 1 characters: y reaches one past x.
        self.windows = max(len(self.data) - 1, 0) // block_size

    def __len__(self) -> int:
        return self.windows

    def __getitem__(self, i: int):
        if not -self.windows <= i < self.windows:
            raise IndexError(f"window {i} of {self.windows}")
        start = (i % self.windows) * self.block_size
        chunk = self.data[start:start + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]

    def __getitems__(self, indices):
        """A whole batch at once (the launcher's loader asks for it): one gather, no Python per item."""
        index = torch.as_tensor(indices)
        if len(index) and not bool(((index >= -self.windows) & (index < self.windows)).all()):
            raise IndexError(f"a window of {indices} is outside 0..{self.windows - 1}")
        starts = (index % self.windows) * self.block_size
        chunks = self.data[starts[:, None] + torch.arange(self.block_size + 1)].long()
        return chunks[:, :-1].contiguous(), chunks[:, 1:].contiguous()

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)
