"""Text read as a stream with HF `datasets` (`pip install -c constraints.txt -e ".[datasets]"`): JSON-lines or
Parquet files, local or remote, tokenized on the fly one token per UTF-8 byte as `passages.py` does, for the
HF causal-LM recipe.

    data:
      train: {_target_: recipes.components.text_stream.text_stream, files: "corpus/*.jsonl"}

Each row's `field` (a string) becomes `{"input_ids", "attention_mask", "labels"}` lists of at most
`max_len` tokens, the first `prompt` labels -100 (`launcher.data.collate.Pad` pads them into tensors). The result is an HF `datasets.IterableDataset`: the
launcher splits it over ranks with its own hook (whole files per rank where they divide evenly) and
resumes it from its `state_dict()`.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Dict, List, Optional, Union


def tokenize(row: Dict[str, Any], field: str, max_len: int, prompt: int) -> Dict[str, List[int]]:
    ids = list(row[field].encode("utf-8")[:max_len])
    labels = [-100] * min(prompt, len(ids)) + ids[prompt:]
    return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels}


def text_stream(files: Union[str, List[str]], field: str = "text", max_len: int = 96, prompt: int = 8,
                format: str = "json", cache_dir: Optional[str] = None):
    """An HF IterableDataset of tokenized rows of `files` (a path, a glob, or a list of them); `format` is
    json or parquet; `cache_dir` is where HF keeps its locks (default: HF's cache in the home folder)."""
    from datasets import load_dataset

    stream = load_dataset(format, data_files=files, split="train", streaming=True, cache_dir=cache_dir)
    return stream.map(partial(tokenize, field=field, max_len=max_len, prompt=prompt), remove_columns=[field])
