"""Checkpoints: written so that a crash at any instant leaves the newest complete one readable, read
without running anything in them, resumed under any strategy at any world size.

    <run_dir>/checkpoints/step_<N>/   one complete checkpoint, in a format of formats.py (full, sharded),
                                      its manifest.json written last
    <run_dir>/checkpoints/latest      names the newest complete checkpoint
    (checkpoint.dir moves the checkpoints elsewhere: another folder, or s3://bucket/prefix, storage.py)
    <run_dir>/model.pt                the final model

This face is what the rest of the launcher uses; one file per concern behind it:
    manager.py    Checkpoints: save, resume, finish an asynchronous save (run/train.py uses it)
    formats.py    the formats, in the order a folder is recognised: full.py, sharded.py, hf.py (read, and
                  written by export --format hf)
    layout.py     step folders, `latest`, choosing one to resume, sealing, retention
    manifest.py   manifest.json: complete and undamaged
    files.py      atomic writes with CRC-32 and fsync; weights-only reads
    storage.py    where checkpoints live: a local folder, or an object store's by URL (s3://, checked)
    prefix_lock.py one live run on an object store's prefix, as a run folder's lock keeps a folder
    run_state.py  the run state beside the model and optimizer, checked field by field
    weights.py    the plain model's weights from any checkpoint, run folder or file (export, init_from)
    sliced.py     the same read into a sharded model, each rank its own slices (init_from under fsdp)
    adapters.py   a peft model seen as the model it adapts (init_from of the base model's weights)
    hf_tokenizer.py the tokenizer's files copied beside an exported HF folder, from the folder the run's came from
    hf_layout.py  an HF model's tensors as published folders hold them (each expert's matrices) and as the
                  model holds them (fused 3-D experts), by transformers' own conversion mapping
    fitting.py    whether weights fit a model, naming the first difference
    dcp_safe.py   DCP's files read without unpickling anything but data
    dcp_io.py     DCP's streams: CRC-32s kept while shards are written; an object store's items fetched exactly
    untrusted.py  safetensors headers (validated by the safetensors library) and a model folder's JSON,
                  checked before anything they describe is read
"""

from launcher.checkpoint.adapters import config_of as adapter_config, is_adapted, keep_config as keep_adapter_config
from launcher.checkpoint.adapters import unmerged
from launcher.checkpoint.files import crc32, write_text
from launcher.checkpoint.hf import config_of as model_config, keep_config, named_configs
from launcher.checkpoint.hf_tokenizer import checked as export_tokenizer
from launcher.checkpoint.layout import choose, complete, folder_of, settle, step_of, steps
from launcher.checkpoint.manager import Checkpoints
from launcher.checkpoint.manifest import is_complete, verify
from launcher.checkpoint.run_state import RunState
from launcher.checkpoint.sliced import load as load_into_shards
from launcher.checkpoint.weights import load_model_state

__all__ = ["Checkpoints", "RunState", "adapter_config", "keep_adapter_config", "choose", "complete", "crc32", "export_tokenizer", "folder_of", "is_adapted", "is_complete", "keep_config", "load_into_shards", "load_model_state",
           "model_config", "named_configs", "settle", "step_of", "steps", "unmerged", "verify", "write_text"]
