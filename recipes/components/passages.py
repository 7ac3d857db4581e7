"""Variable-length passages of a text file as HF-style token items, for causal language models.

Item i is a dict `{"input_ids", "attention_mask", "labels"}` of LongTensors of one length between
`min_len` and `max_len` (the length and the start are drawn from `seed`, `split` and i), one token per
UTF-8 byte (a vocabulary of 256). The first `prompt` labels are -100: like an instruction prompt, they
are read and not predicted, so passages differ in how many tokens they train on. `with_id` adds a
string field, as a dataset read from files carries. Padding is the collate's work
(`launcher.data.collate.Pad`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import Dataset

ROOT = Path(__file__).resolve().parents[2]


class Passages(Dataset):
    def __init__(self, path: str = "recipes/data/hamlet.txt", n: int = 1024, min_len: int = 8, max_len: int = 64,
                 prompt: int = 0, seed: int = 0, split: int = 0, with_id: bool = False):
        if not 1 <= min_len <= max_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got {min_len} and {max_len}")
        if not 0 <= prompt < min_len:
            raise ValueError(f"prompt must be from 0 to min_len - 1, got {prompt}")
        file = Path(path)
        if not file.is_absolute() and not file.exists():
            file = ROOT / file
        self.bytes = torch.tensor(list(file.read_bytes()), dtype=torch.long)
        if len(self.bytes) <= max_len:
            raise ValueError(f"{file} is shorter than max_len {max_len}")
        g = torch.Generator().manual_seed(seed * 1000 + split)
        self.lengths = torch.randint(min_len, max_len + 1, (n,), generator=g)
        self.starts = torch.randint(0, len(self.bytes) - max_len, (n,), generator=g)
        self.prompt, self.split, self.with_id = prompt, split, with_id

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict:
        start, length = int(self.starts[i]), int(self.lengths[i])
        ids = self.bytes[start:start + length].clone()
        labels = ids.clone()
        labels[:self.prompt] = -100
        item = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
        if self.with_id:
            item["id"] = f"passage-{self.split}-{i}"
        return item
