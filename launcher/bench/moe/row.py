"""The MoE row of python -m launcher.bench (`--moe` prints it alone): expert parallelism against fsdp alone on
the same mixture of experts, the same ranks and the same global batch, each run a fresh torchrun, alternating,
the order reversed every repetition. Its GPU row is launcher/bench/moe/gpu.py (python -m launcher.bench.gpu --moe).

The model is a Qwen3-MoE built from its config (transformers.Qwen3MoeConfig, every layer a mixture of experts,
the experts' kernel the config's default), trained by recipes/hf_causal_lm.yaml with AdamW on passages of one
length (no padding: every step the same tokens). Its router's load-balancing loss is trained (coef 0.01): a
random router left alone sends most tokens to a few experts, which a trained model's does not, and under ep the
rank holding them would set every step. Two sides on N ranks: fsdp x N (each rank holds 1/N of every expert and
gathers a layer's E experts to run it) and fsdp x N with parallel.ep=N (each rank holds E/N experts of a layer,
whole; the tokens travel to them and back by all-to-all).

Every figure is read from what the runs write, not timed inside the loop:

- the step: the global batch over `train/samples_per_s` of each log interval of metrics.jsonl, the median after
  the first quarter of the intervals (the steady step); tokens/s the same way (`train/tokens_per_s`). ep / fsdp
  is taken per pair of runs made next to each other: its median and range over the repetitions.
- held per rank: the run's line `memory on rank 0: parameters ..., gradients ..., optimizer state ...` (rank 0's
  own shares at the end: what a rank holds at rest).
- the peak per rank: the line `memory: X MiB per rank at the peak` of a short run of each side made for it
  (logging.memory_plan on: torch's memory tracker over one step, on the CPU). The timed runs leave the planner
  out: its process beside rank 0 would take a core of two.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from launcher.bench.runs import ABORT_AT_EXIT, PY, REPO, aborted_at_exit

# Every size's config keys besides its shape: byte tokens, the router's weights normalised over its top k (as
# Qwen3-30B-A3B's), an untied head, and the load-balancing loss trained.
COMMON = dict(vocab_size=256, norm_topk_prob=True, tie_word_embeddings=False, output_router_logits=True,
              router_aux_loss_coef=0.01)
CPU = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2)
BATCH, TOKENS = 16, 64  # the CPU row's global batch of passages, each of TOKENS tokens
LOG_EVERY = 10
WAIT = 900  # seconds a run may take
HELD = re.compile(r"memory on rank 0: parameters ([\d.]+) MiB, gradients ([\d.]+) MiB, optimizer state ([\d.]+) MiB")
PEAK = re.compile(r"memory: ([\d.]+) MiB per rank at the peak")


def moe_options(parser: argparse.ArgumentParser) -> None:
    """This row's options, on python -m launcher.bench's parser."""
    parser.add_argument("--moe", dest="moe_only", action="store_true",
                        help="the MoE row alone: a Qwen3-MoE under ep x2 against fsdp x2 (step ratio, bytes per rank)")
    parser.add_argument("--moe-steps", type=steps_option, default=100,
                        help=f"steps per run of the MoE row (default 100; at least {2 * LOG_EVERY}: a log line every "
                        f"{LOG_EVERY} steps, the step their median)")


def steps_option(text: str) -> int:
    if not re.fullmatch(r"\d+", text) or int(text) < 2 * LOG_EVERY:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number of steps, {2 * LOG_EVERY} or more")
    return int(text)


def recipe(shape: dict, batch: int, tokens: int, steps: int, device: str, precision: str) -> List[str]:
    """recipes/hf_causal_lm.yaml and its overrides: the Qwen3-MoE of `shape`, passages of `tokens`, fsdp."""
    model = {"_target_": "transformers.Qwen3MoeForCausalLM",
             "config": {"_target_": "transformers.Qwen3MoeConfig", **COMMON, **shape, "max_position_embeddings": tokens}}
    data = {"_target_": "recipes.components.passages.Passages", "n": 4096, "min_len": tokens, "max_len": tokens}
    return ["recipes/hf_causal_lm.yaml", f"model={json.dumps(model)}", f"data.train={json.dumps(data)}", "data.val=null",
            "metrics={}", f"data.batch_size={batch}", f"trainer.max_steps={steps}", f"trainer.log_every={LOG_EVERY}",
            "trainer.eval_every=null", "checkpoint.every=null", "checkpoint.resume=never", "checkpoint.consolidate=never",
            "logging.tensorboard=false", "logging.progress_bar=false", "logging.jsonl=true", f"devices={device}",
            f"precision={precision}", "strategy=fsdp"]


def torchrun(processes: int) -> List[str]:
    return [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}", "-m", "launcher"]


def run(command: List[str], folder: Path) -> Tuple[Dict[int, dict], str]:
    """One run to its end in `folder`: its metrics.jsonl by step, and what it said (stdout and stderr)."""
    shutil.rmtree(folder, ignore_errors=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*command, f"run_dir={folder}"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=WAIT)
    said = done.stdout + done.stderr
    if done.returncode != 0:
        # torch 2.13's gloo may abort a process after it finished (launcher/bench/runs.py): its figures count
        if ABORT_AT_EXIT in done.stderr and re.search(r"done: step \d+", said):
            aborted_at_exit.append(f"MoE row, {folder.name}")
        else:
            raise SystemExit(f"benchmark run failed (exit {done.returncode}): {' '.join(command)}\n{said[-3000:]}")
    rows = (folder / "metrics.jsonl").read_text().splitlines()
    return {row["step"]: row for row in map(json.loads, rows)}, said


def steady(rows: Dict[int, dict], batch: int, before: Optional[int] = None) -> Dict[str, float]:
    """A run's steady step (seconds) and tokens/s: the medians over its log intervals (those ending before step
    `before`, where given), after the first quarter of them (the first steps' warm-up)."""
    kept = [row for step, row in sorted(rows.items())
            if "train/samples_per_s" in row and (before is None or step < before)]
    kept = kept[len(kept) // 4:]
    if not kept:
        raise SystemExit(f"benchmark run logged no interval to measure (steps {sorted(rows)}, before {before})")
    return {"step_s": statistics.median(batch / row["train/samples_per_s"] for row in kept),
            "tokens_per_s": statistics.median(row["train/tokens_per_s"] for row in kept)}


def held(said: str) -> Dict[str, float]:
    """MiB rank 0 holds at the end, from the run's line."""
    found = HELD.search(said)
    if found is None:
        raise SystemExit(f"benchmark run printed no 'memory on rank 0' line:\n{said[-3000:]}")
    return dict(zip(("parameters", "gradients", "optimizer state"), map(float, found.groups())))


def load(rows: Dict[int, dict]) -> Tuple[float, float]:
    """The last interval's expert load: the most and least loaded expert's share, means over the layers."""
    last = rows[max(step for step, row in rows.items() if "moe/load_max" in row)]
    return last["moe/load_max"], last["moe/load_min"]


def alternated(sides: Dict[str, List[str]], reps: int, folder: Path, batch: int,
               before: Optional[int] = None) -> Dict[str, List[dict]]:
    """Each side `reps` times, the order reversed every repetition; per run its steady figures, what rank 0 holds,
    the expert load, and on CUDA the peak allocated."""
    out: Dict[str, List[dict]] = {name: [] for name in sides}
    for rep in range(reps):
        order = list(sides.items())
        for name, command in order if rep % 2 == 0 else reversed(order):
            rows, said = run(command, folder / f"{name.replace(' ', '_')}-{rep}")
            memory = [row["train/max_memory_gib"] for row in rows.values() if "train/max_memory_gib" in row]  # CUDA's
            out[name].append({**steady(rows, batch, before), "held": held(said), "load": load(rows),
                              "max_memory_gib": max(memory, default=None)})
    return out


def ratios(res: Dict[str, List[dict]], side: str, base: str) -> Tuple[float, float, float]:
    """Median, min and max over repetitions of side / base step, each pair measured next to each other."""
    r = [a["step_s"] / b["step_s"] for a, b in zip(res[side], res[base])]
    return statistics.median(r), min(r), max(r)


def moe(args) -> List[str]:
    """The CPU row: fsdp x2 and ep x2 on gloo, two processes on this machine."""
    if importlib.util.find_spec("transformers") is None:
        return ["MoE row skipped: transformers is not installed (pip install -c constraints.txt -e '.[hf]')"]
    steps, folder = args.moe_steps, Path(args.run_dir) / "moe"
    base = [*torchrun(2), *recipe(CPU, BATCH, TOKENS, steps, "cpu", "fp32")]
    sides = {"fsdp x2": base, "ep x2": [*base, "parallel.ep=2"]}
    res = alternated(sides, args.reps, folder, BATCH)
    peaks = {}
    for name, command in sides.items():  # a short run each, the tracker on: the peak of one step
        _, said = run([*command, "trainer.max_steps=3", "trainer.log_every=1", "logging.memory_plan=true"],
                      folder / f"{name.replace(' ', '_')}-peak")
        found = PEAK.search(said)
        peaks[name] = float(found.group(1)) if found else None
    r, lo, hi = ratios(res, "ep x2", "fsdp x2")
    most, least = (statistics.median(run["load"][i] for run in res["ep x2"]) for i in (0, 1))
    lines = [f"MoE (gloo, 2 processes): Qwen3-MoE from its config, {CPU['num_hidden_layers']} layers of "
             f"{CPU['num_experts']} experts (top {CPU['num_experts_per_tok']}, hidden {CPU['hidden_size']}, experts "
             f"{CPU['moe_intermediate_size']} wide), AdamW, fp32, batch {BATCH} of {TOKENS} tokens, {steps} steps, "
             f"{args.reps} alternating repetitions (python -m launcher.bench --moe --moe-steps {steps} --reps {args.reps})",
             f"{'':8} {'step':>9} {'tokens/s':>9} {'parameters':>11} {'gradients':>10} {'optimizer':>10} "
             f"{'per rank':>10} {'peak':>9}  step / fsdp x2 (range)"]
    for name in sides:
        mib = {k: statistics.median(run["held"][k] for run in res[name]) for k in res[name][0]["held"]}
        peak = f"{peaks[name]:.1f}MiB" if peaks[name] is not None else "-"
        tail = f"{r:.3f} ({lo:.3f}-{hi:.3f})" if name == "ep x2" else "1"
        lines.append(f"{name:8} {statistics.median(x['step_s'] for x in res[name]) * 1e3:7.2f}ms "
                     f"{statistics.median(x['tokens_per_s'] for x in res[name]):9,.0f} {mib['parameters']:8.2f}MiB "
                     f"{mib['gradients']:7.2f}MiB {mib['optimizer state']:7.2f}MiB {sum(mib.values()):7.2f}MiB "
                     f"{peak:>9}  {tail}")
    even = CPU["num_experts_per_tok"] / CPU["num_experts"]
    lines.append(f"expert load at the end (ep x2's last interval, mean over layers): the most loaded expert's share "
                 f"{most:.3f}, the least's {least:.3f} (even: {even:.3f})")
    return lines
