"""The SFT row of python -m launcher.bench (`--sft` prints it alone) and of python -m launcher.bench.gpu (`--sft`):
chat fine-tuning by recipes/hf_sft.yaml on instruction data whose lengths have a long tail, padded against packed,
and TRL's SFTTrainer packing the same samples (launcher/bench/sft/peer.py), alternating, each run a fresh process.

The data is written here, the same for every run: conversations of one user turn and one answer whose lengths
in tokens are drawn from a lognormal (as real instruction data's are: most short, a few long), clipped to the
size's range, from a fixed seed. The model is a random Llama in an HF folder with its small BPE tokenizer and
ChatML template (recipes/components/hf_folder.py). Each side starts from the folder's weights, with AdamW at the
recipe's learning rate, a constant schedule, no clipping, and recomputation at each side's default (the
recipe's `activation_checkpointing: auto`, SFTConfig's `gradient_checkpointing=True`).

What counts is real tokens a second: the tokens of the samples, never padding. A padded batch holds
`batch` samples, a packed one `batch` rows, so a step's real tokens are `batch` x the mean tokens of a
sample, or of a row (the samples' tokens over the rows; TRL reports its own rows); over the sampler's random
batches that mean is what a step holds, and it is divided by the mean step (steps vary with what they hold).
Repetition r runs every side with seed r: the step ratios are medians over repetitions of runs made next to
each other, and the final losses' spread over seeds is what "the same loss" is judged by."""

from __future__ import annotations

import json
import math
import random
import statistics
from pathlib import Path

from launcher.bench.runs import PY, measure

# n conversations, lengths lognormal around `median` tokens (sigma 1), clipped to [low, high]; rows of max_len
SIZES = {
    "small": dict(layers=2, width=64, n=1024, median=64, low=16, high=512, max_len=512, batch=8),
    "tiny": dict(layers=2, width=64, n=96, median=24, low=16, high=128, max_len=128, batch=4),
    "1B": dict(layers=16, width=2048, intermediate=8192, heads=32, kv_heads=8, vocab=128256, tie=True, context=2048,
               dtype="bf16", n=4096, median=200, low=20, high=2000, max_len=2048, batch=8),
}
WORDS = ("what is the next number please write you are a helpful assistant who answers in one sentence hello how "
         "can i help today capital of france paris quick brown fox jumps over lazy dog thank that right plus "
         "times minus so answer which check by").split()
LOG_EVERY = 10
TOKENS_PER_WORD = 1.7  # recipes/components/tiny_tokenizer.bpe on WORDS, measured


def write_data(path: Path, n: int, median: int, low: int, high: int, seed: int = 0) -> None:
    """n conversations (a user turn, then the answer) as JSON Lines, each of about a length in tokens drawn from a
    lognormal around `median` and clipped to [low, high] (words of the tiny BPE's vocabulary, so that the tokens
    follow from the words): a function of its arguments alone. The row prints the lengths the tokenizer made."""
    draw = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            length = min(max(round(draw.lognormvariate(math.log(median), 1.0)), low), high)
            # ~14 tokens of template (BOS, two role headers, their ends); the tiny BPE makes ~1.7 tokens of a word
            words = max(round((length - 14) / TOKENS_PER_WORD), 2)
            question = " ".join(draw.choice(WORDS) for _ in range(max(words // 4, 1)))
            answer = " ".join(draw.choice(WORDS) for _ in range(words - words // 4))
            f.write(json.dumps({"messages": [{"role": "user", "content": question + "?"},
                                             {"role": "assistant", "content": answer + "."}]}) + "\n")


def prepare(run_dir: Path, size: str) -> tuple[Path, Path, dict]:
    """The model folder, the data file and what the data is: its samples' tokens, and the rows packing makes of
    them (with seed 0: another seed changes which equal lengths go where, not how many rows)."""
    from launcher.data.text import TextDataset
    from recipes.components.hf_folder import write

    shape = SIZES[size]
    folder, data = run_dir / "sft-model", run_dir / "sft-chat.jsonl"
    model = {k: shape[k] for k in ("layers", "width", "intermediate", "heads", "kv_heads", "vocab", "tie", "context", "dtype")
             if k in shape}
    write(str(folder), context=max(shape["max_len"], model.pop("context", 0)), **model)
    write_data(data, shape["n"], shape["median"], shape["low"], shape["high"])
    padded = TextDataset(str(folder), str(data), max_len=shape["max_len"])
    packed = TextDataset(str(folder), str(data), max_len=shape["max_len"], packing=True, batch_size=shape["batch"])
    lengths = [len(s["input_ids"]) for s in padded.samples]
    return folder, data, {"samples": len(lengths), "tokens": sum(lengths), "min": min(lengths), "max": max(lengths),
                          "rows": len(packed), "padding": packed.notes[-1]}


def sides(args, size: str, device: str, folder: Path, data: Path, seed: int) -> dict:
    """Ours padded, ours packed and TRL packed, for one seed: each a command and its environment."""
    shape, cuda = SIZES[size], device.startswith("cuda")
    ours = [PY, "-m", "launcher.bench.child", "recipes/hf_sft.yaml", "on_cpu=null",
            f"precision={'bf16' if cuda else 'fp32'}", f"devices={device}", f"seed={seed}",
            f"model.config.pretrained_model_name_or_path={folder}", f"data.train.files={data}",
            f"data.train.max_len={shape['max_len']}", f"data.batch_size={shape['batch']}",
            f"trainer.max_steps={args.sft_steps}", f"trainer.log_every={LOG_EVERY}", "checkpoint.every=null",
            "checkpoint.consolidate=never", "checkpoint.resume=never", "logging.tensorboard=false",
            "logging.progress_bar=false"]
    peer = [PY, "-m", "launcher.bench.sft.peer", str(folder), str(data), str(args.sft_steps), str(shape["batch"]),
            str(shape["max_len"]), str(seed), str(LOG_EVERY)]
    return {"padded": ([*ours, "data.train.packing=false", f"run_dir={args.run_dir}/sft-padded"], {}),
            "packed": ([*ours, "data.train.packing=true", f"run_dir={args.run_dir}/sft-packed"], {}),
            "trl": (peer, {})}


def run(args, size: str, device: str) -> tuple[dict, dict]:
    """Every side once per repetition (seed = the repetition), in an order reversed every repetition."""
    folder, data, facts = prepare(Path(args.run_dir), size)
    peer = getattr(args, "peers", True)  # python -m launcher.bench.gpu --sft --no-peers: without TRL's side
    results: dict = {"padded": [], "packed": [], **({"trl": []} if peer else {})}
    for rep in range(args.reps):
        made = [(name, side) for name, side in sides(args, size, device, folder, data, seed=rep).items() if name in results]
        for name, (command, env) in made if rep % 2 == 0 else reversed(made):
            results[name].append(measure(command, env))
    return {name: runs for name, runs in results.items() if None not in runs}, facts


def report(res: dict, facts: dict, size: str, command: str, peer: bool = True) -> list[str]:
    """The row's lines: the data, then per side its mean step, real tokens/s and final loss, and the ratios."""
    shape = SIZES[size]
    per_item = {"padded": facts["tokens"] / facts["samples"], "packed": facts["tokens"] / facts["rows"]}
    if "trl" in res:
        per_item["trl"] = statistics.median(r["tokens"] / r["rows"] for r in res["trl"])
    rate = {name: [shape["batch"] * per_item[name] / (r["mean_step_us"] / 1e6) for r in runs]
            for name, runs in res.items()}
    lines = [f"SFT: {facts['samples']} chat samples of {facts['min']} to {facts['max']} tokens (lognormal around "
             f"{shape['median']}, {facts['tokens']} tokens), batch {shape['batch']}, max_len {shape['max_len']}, "
             f"{len(res['padded'])} alternating repetitions, seed = repetition ({command})",
             f"  {facts['padding']}",
             f"{'':24} {'mean step':>10} {'real tokens/s':>14} {'final loss (seeds)':>26}"]
    names = {"padded": "ours, padded", "packed": "ours, packed", "trl": "TRL SFTTrainer, packed"}
    for name, runs in res.items():
        losses = [r["loss"] for r in runs]
        lines.append(f"{names[name]:24} {statistics.median(r['mean_step_us'] for r in runs) / 1e3:8.2f}ms "
                     f"{statistics.median(rate[name]):14,.0f} {statistics.median(losses):12.4f} "
                     f"({min(losses):.4f}-{max(losses):.4f})")
    gain = [p / q for p, q in zip(rate["packed"], rate["padded"])]
    lines.append(f"packed / padded real tokens/s {statistics.median(gain):.3f} ({min(gain):.3f}-{max(gain):.3f})")
    if "trl" not in res and not peer:
        return lines + ["TRL peer skipped (--no-peers)"]
    if "trl" not in res:
        return lines + ["TRL peer skipped: trl is not installed (pip install -c constraints.txt 'launcher[trl]')"]
    step = [o["mean_step_us"] / t["mean_step_us"] for o, t in zip(res["packed"], res["trl"])]
    token = [t / o for o, t in zip(rate["packed"], rate["trl"])]
    return lines + [f"ours / TRL, packed: step {statistics.median(step):.3f} ({min(step):.3f}-{max(step):.3f}), "
                    f"time per real token {statistics.median(token):.3f} ({min(token):.3f}-{max(token):.3f}) "
                    f"(issue 35 asks <= 0.95)"]


def sft(args, size: str, device: str, command: str) -> list[str]:
    """The row, measured and printed as lines; `args` gives reps, sft_steps and run_dir."""
    res, facts = run(args, size, device)
    if not {"padded", "packed"} <= set(res):
        raise SystemExit(f"SFT row: a side gave no figures ({', '.join(res) or 'none'} did)")
    return report(res, facts, size, command, getattr(args, "peers", True))
