"""The pretrained row of python -m launcher.bench (`--pretrained` prints it alone): host memory per rank
to load a Llama-shaped model from an HF folder under fsdp x2 (gloo), built on the meta device with each
rank reading its own slices (the default), against every rank building and loading the whole model
(`fsdp.empty_init=false`, as before). The bound is issue 25's: (the fp32 model's bytes / 2) x 1.15 + the
process's memory without a model (the same run of a model of one layer of width 16). Each figure is the
run's own line `host memory: N MiB at most on rank 0 up to here, the pretrained weights loaded`."""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

from launcher.bench.runs import PY, REPO

RUN = ["recipes/hf_finetune.yaml", "strategy=fsdp", "nproc_per_node=2", "on_cpu=null", "precision=fp32",
       "trainer.max_steps=1", "trainer.eval_every=null", "data.val=null", "data.batch_size=2",
       "trainer.activation_checkpointing=null", "checkpoint.every=null", "checkpoint.consolidate=never",
       "checkpoint.resume=never", "logging.tensorboard=false", "logging.progress_bar=false", "devices=cpu",
       # no memory planner beside training (a process of its own, started after the figure is taken: it would
       # only take a core from the rest of the run)
       "logging.memory_plan=false"]


def pretrained(args) -> list[str]:
    if importlib.util.find_spec("transformers") is None:
        return ["pretrained row skipped: transformers is not installed (pip install 'launcher[dev]')"]
    base = Path(args.run_dir)
    big = _folder(base / "big", args.pretrained_layers, args.pretrained_width)
    tiny = _folder(base / "tiny", 1, 16)
    params = sum(f.stat().st_size for f in big.glob("*.safetensors")) / 4
    without = _peak(tiny, base / "tiny_run")
    bound = without + params * 4 / 2 / 2**20 * 1.15
    empty, whole = _peak(big, base / "empty_run"), _peak(big, base / "whole_run", "fsdp.empty_init=false")
    return [f"pretrained: a Llama of {params / 1e6:.0f}M parameters ({args.pretrained_layers} layers of width "
            f"{args.pretrained_width}) from an HF folder under fsdp x2, rank 0's peak host memory once loaded "
            f"(python -m launcher.bench --pretrained)",
            f"{'built on meta, slices read':28} {empty:8.0f} MiB  (bound {bound:.0f} MiB: {'met' if empty <= bound else 'NOT met'})",
            f"{'built whole on every rank':28} {whole:8.0f} MiB  (fsdp.empty_init=false)",
            f"{'a process without a model':28} {without:8.0f} MiB"]


def _folder(path: Path, layers: int, width: int) -> Path:
    from recipes.components.hf_folder import write

    write(str(path), layers=layers, width=width)
    return path


def _peak(folder: Path, run_dir: Path, *extra: str) -> float:
    done = subprocess.run([PY, "-m", "launcher", *RUN, f"model.config.pretrained_model_name_or_path={folder}",
                           f"run_dir={run_dir}", *extra], cwd=REPO, capture_output=True, text=True, timeout=900)
    found = re.search(r"host memory: (\d+) MiB at most on rank 0", done.stdout)
    if done.returncode != 0 or not found:
        raise SystemExit(f"pretrained row: the run failed (exit {done.returncode})\n{done.stderr[-3000:]}")
    return float(found.group(1))
