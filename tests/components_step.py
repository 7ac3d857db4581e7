"""Models, data and steps shaped as users write them, for the step tests."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset


class RandomDataset(Dataset):
    """The DataParallel tutorial's dataset: inputs only, no target."""

    def __init__(self, size: int = 8, length: int = 256):
        self.data = torch.randn(length, size, generator=torch.Generator().manual_seed(0))

    def __getitem__(self, index):
        return self.data[index]

    def __len__(self):
        return len(self.data)


class AutoEncoder(nn.Module):
    """A model that returns its own loss (the reconstruction error) from its input alone."""

    def __init__(self, size: int = 8, hidden: int = 4):
        super().__init__()
        self.encode, self.decode = nn.Linear(size, hidden), nn.Linear(hidden, size)

    def forward(self, x):
        return (self.decode(torch.tanh(self.encode(x))) - x).pow(2).mean()


def masked_step(model, batch, loss):
    """A custom step (a plain function: `_partial_: true`) that counts its items: the labels that are targets."""
    output = model(batch["input_ids"])
    logits, labels = output.logits[:, :-1], batch["labels"][:, 1:]
    return {"loss": loss(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)),
            "num_items": (labels != -100).sum(), "output": output, "target": batch["labels"]}


def top1(output, target):
    """A metric written for a tensor of logits: a ModelOutput has no argmax."""
    return (output.argmax(-1) == target).float()
