"""A map-style dataset of pre-tokenized samples packed into rows by launcher/data/text/packing.py: what the
text data (launcher/data/text/) gives with `packing: true`, built here on byte passages so that the packing
tests (tests/test_packing_runs.py, tests/packed.yaml) depend on nothing else."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from launcher.data.text.packing import join, padding, plan
from recipes.components.passages import Passages


class PackedTokens(Dataset):
    """`n` byte passages of `min_len` to `max_len` tokens (their first `prompt` labels -100), packed into rows of
    at most `row_len` tokens from `seed`; with `packing` false, one passage per item (for the Pad collate)."""

    def __init__(self, n: int = 256, min_len: int = 8, max_len: int = 64, row_len: int = 64, prompt: int = 2,
                 seed: int = 0, packing: bool = True, batch_size: int = 8):
        passages = Passages(n=n, min_len=min_len, max_len=max_len, prompt=prompt, seed=seed)
        self.samples = [{"input_ids": p["input_ids"].tolist(), "labels": p["labels"].tolist()} for p in passages]
        lengths = [len(s["input_ids"]) for s in self.samples]
        self.rows = plan(lengths, row_len, seed) if packing else [[i] for i in range(n)]
        self.packing = packing
        self.said = padding(lengths, self.rows, row_len, batch_size, seed)  # the line a text dataset prints

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        if not self.packing:
            return {k: torch.tensor(v) for k, v in self.samples[self.rows[i][0]].items()}
        return {k: torch.tensor(v) for k, v in join([self.samples[j] for j in self.rows[i]]).items()}
