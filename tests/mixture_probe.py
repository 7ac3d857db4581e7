"""A step that records the samples of every training step, for tests/test_mixture.py: the model's own loss, and
one JSON line a step in FOLDER/rank<R>.jsonl holding the token ids of each of the rank's samples (padding left
out), so that runs at other world sizes and resumed runs can be compared item by item."""

import json
import os
from pathlib import Path

from launcher.model.step import ModelLoss


class Recorded(ModelLoss):
    def __init__(self, folder: str):
        super().__init__()
        self.file = Path(folder) / f"rank{os.environ.get('RANK', '0')}.jsonl"
        self.file.parent.mkdir(parents=True, exist_ok=True)

    def __call__(self, model, batch):
        if model.training:  # not the check of the first batch before training
            rows = [ids[mask.bool()].tolist() for ids, mask in zip(batch["input_ids"], batch["attention_mask"])]
            with open(self.file, "a") as f:
                f.write(json.dumps(rows) + "\n")
        return super().__call__(model, batch)


def steps(folder: Path, ranks: int = 1) -> list:
    """Each step's samples, as a sorted list of token-id tuples over the ranks."""
    per_rank = [[json.loads(line) for line in (folder / f"rank{r}.jsonl").read_text().splitlines()]
                for r in range(ranks)]
    assert len({len(rank) for rank in per_rank}) == 1, [len(rank) for rank in per_rank]
    return [sorted(tuple(row) for rank in per_rank for row in rank[i]) for i in range(len(per_rank[0]))]
