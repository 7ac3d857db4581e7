"""The rows of python -m launcher.bench that time the launcher's loop against a hand-written one, step by step:
the reference workload (1 process and DDP x2, with Accelerate and Lightning as peers where installed), the HF
model (against a hand-written HF loop and HF Trainer), the loggers, and scaling from 1 to 2 DDP processes.
Each returns its lines; the command's docstring (launcher/bench/__main__.py) says what each row measures.
"""

from __future__ import annotations

import importlib.util
import statistics

from launcher.bench.runs import PY, alternate, median, ratio

TORCHRUN = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
SCALING = {"batch": 1024, "width": 1024}  # compute-bound: the step is matmuls, not Python


HEADER = (f"{'':16} {'step raw':>9} {'ours':>7}  {'ratio (range)':<19} {'per-item':>8}  "
          f"{'1st step raw':>12} {'ours':>5} {'+':>6}  {'RSS raw':>8} {'ours':>7} {'+':>6}")


def row(name: str, res: dict, per_item: str) -> str:
    """One line of the table: raw and ours side by side, and ours / raw."""
    r, lo, hi = ratio(res, "ours")
    step = {k: median(res[k], "median_step_us") for k in ("raw", "ours")}
    first = {k: median(res[k], "first_step_s") for k in ("raw", "ours")}
    rss = {k: median(res[k], "peak_rss_mib") for k in ("raw", "ours")}
    return (f"{name:16} {step['raw']:7.0f}us {step['ours']:5.0f}us  {r:5.3f} ({lo:.3f}-{hi:.3f})  {per_item:>8}  "
            f"{first['raw']:11.2f}s {first['ours']:4.2f}s {first['ours'] - first['raw']:+5.2f}s  "
            f"{rss['raw']:5.0f}MiB {rss['ours']:4.0f}MiB {rss['ours'] - rss['raw']:+4.0f}MiB")


def workload(args) -> list[str]:
    steps = str(args.steps)
    recipe = ["recipes/bench.yaml", f"trainer.max_steps={steps}", f"run_dir={args.run_dir}/bench"]
    installed = {"accelerate": ("accelerate",), "lightning": ("lightning", "pytorch_lightning")}
    peers = [p for p, names in installed.items() if args.peers and any(importlib.util.find_spec(n) for n in names)]
    configs = [("1 process", [])] + ([("DDP x2 (gloo)", TORCHRUN)] if args.ddp else [])
    lines = [f"reference workload, {steps} steps, {args.reps} alternating repetitions "
             f"(python -m launcher.bench --steps {steps} --reps {args.reps})", HEADER]
    for name, launch in configs:
        sides = {"raw": ([*(launch or [PY]), "-m", "launcher.bench.loop.raw", steps], {}),
                 "ours": ([*(launch or [PY]), "-m", "launcher.bench.child", *recipe], {}),
                 "per-item": ([*(launch or [PY]), "-m", "launcher.bench.child", *recipe], {"BENCH_FETCH": "per-item"})}
        for peer in peers:
            sides[peer] = ([*(launch or [PY]), "-m", f"launcher.bench.loop.peer_{peer}", steps], {})
        res = alternate(sides, args.reps)
        lines.append(row(name, res, f"{ratio(res, 'per-item')[0]:.3f}"))
        for peer in peers:
            if peer in res:
                p, plo, phi = ratio(res, peer)
                lines.append(f"{'':16} peer {peer}: {median(res[peer], 'median_step_us'):.0f}us per step, "
                             f"ratio to raw {p:.3f} ({plo:.3f}-{phi:.3f})")
    return lines


def hf(args) -> list[str]:
    """The HF model through the launcher against the loop an HF user writes by hand."""
    if importlib.util.find_spec("transformers") is None:
        return ["HF row skipped: transformers is not installed (pip install transformers, or --no-hf)"]
    steps = str(args.hf_steps)
    # A benchmark run: no evaluation, checkpoint, TensorBoard, progress bar or metric; the loss read
    # every 100 steps, as the hand-written loop reads it.
    recipe = ["recipes/hf_causal_lm.yaml", f"trainer.max_steps={steps}", "trainer.log_every=100",
              "trainer.eval_every=null", "data.val=null", "metrics={}", "checkpoint.every=null",
              "checkpoint.resume=never", "logging.tensorboard=false", "logging.progress_bar=false",
              "devices=cpu", f"run_dir={args.run_dir}/hf"]
    sides = {"raw": ([PY, "-m", "launcher.bench.loop.raw_hf", steps], {}),
             "ours": ([PY, "-m", "launcher.bench.child", *recipe], {}),
             "trainer": ([PY, "-m", "launcher.bench.loop.peer_trainer", steps], {})}
    res = alternate(sides, args.reps)
    lines = [f"HF model (recipes/hf_causal_lm.yaml: GPT2LMHeadModel on padded passages) against a hand-written "
             f"HF loop (launcher/bench/loop/raw_hf.py) and HF Trainer at its defaults (launcher/bench/loop/peer_trainer.py), "
             f"{steps} steps, {args.reps} alternating repetitions (python -m launcher.bench --hf-steps {steps} "
             f"--reps {args.reps})", HEADER, row("HF GPT-2 1 proc", res, "-")]
    if "trainer" in res:
        t, tlo, thi = ratio({"raw": res["trainer"], "ours": res["ours"]}, "ours")
        lines.append(f"{'':16} peer HF Trainer ({res['trainer'][0].get('optim')}): "
                     f"{median(res['trainer'], 'median_step_us'):.0f}us per step; launcher / Trainer {t:.3f} "
                     f"({tlo:.3f}-{thi:.3f}); last logged loss: launcher {median(res['ours'], 'loss'):.4f}, "
                     f"Trainer {median(res['trainer'], 'loss'):.4f}, hand-written {median(res['raw'], 'loss'):.4f}")
    return lines


def loggers(args) -> list[str]:
    """The reference workload with TensorBoard alone, and with every file-backed logger at once: what
    logging costs per step, its log steps included (the mean step), against the hand-written loop."""
    steps = str(args.steps)
    recipe = ["recipes/bench.yaml", f"trainer.max_steps={steps}"]
    everything = ["logging.tensorboard=true", "logging.jsonl=true",
                  f"logging.mlflow.tracking_uri=file:{args.run_dir}/mlruns",
                  f"profile.at_step={args.steps + 1}"]  # a profiler window after the last step: its check alone
    sides = {"raw": ([PY, "-m", "launcher.bench.loop.raw", steps], {}),
             "tensorboard": ([PY, "-m", "launcher.bench.child", *recipe, "logging.tensorboard=true",
                              f"run_dir={args.run_dir}/tensorboard"], {}),
             "all": ([PY, "-m", "launcher.bench.child", *recipe, *everything, f"run_dir={args.run_dir}/all"],
                     {"MLFLOW_ALLOW_FILE_STORE": "true"})}
    res = alternate(sides, args.reps)
    out = [f"loggers on the reference workload, 1 process, {steps} steps, a log step every 100, {args.reps} alternating "
           f"repetitions (python -m launcher.bench --steps {steps} --reps {args.reps} --loggers)",
           f"{'':24} {'mean step':>10} {'ratio to raw (range)':<22} {'median step':>12} {'ratio':>6}"]
    for name, label in (("raw", "raw"), ("tensorboard", "TensorBoard"), ("all", "TB+MLflow+jsonl+profile")):
        mean, med = median(res[name], "mean_step_us"), median(res[name], "median_step_us")
        r, lo, hi = ratio(res, name, "mean_step_us")
        out.append(f"{label:24} {mean:8.0f}us {r:5.3f} ({lo:.3f}-{hi:.3f})      {med:8.0f}us {ratio(res, name)[0]:6.3f}")
    return out


def scaling(args) -> list[str]:
    steps, batch, width = str(args.scaling_steps), str(SCALING["batch"]), str(SCALING["width"])
    recipe = ["recipes/bench.yaml", f"trainer.max_steps={steps}", f"data.batch_size={batch}",
              f"model.width={width}", f"run_dir={args.run_dir}/scaling"]
    sides = {"raw": ([PY, "-m", "launcher.bench.loop.raw", steps, batch, width], {}),
             "raw x2": ([*TORCHRUN, "-m", "launcher.bench.loop.raw", steps, batch, width], {}),
             "ours": ([PY, "-m", "launcher.bench.child", *recipe], {"BENCH_FETCH": "per-item"}),
             "ours x2": ([*TORCHRUN, "-m", "launcher.bench.child", *recipe], {"BENCH_FETCH": "per-item"})}
    res = alternate(sides, args.reps)
    eff = {}
    for name in ("raw", "ours"):
        pairs = zip(res[name], res[f"{name} x2"])
        eff[name] = statistics.median(one["median_step_us"] / (2 * two["median_step_us"]) for one, two in pairs)
    return [f"scaling, compute-bound (MLP width {width}, global batch {batch}, {steps} steps, {args.reps} repetitions): "
            f"DDP 1 -> 2 processes; both fetch item by item, so that they do the same work",
            f"{'':16} {'1 process':>10} {'2 processes':>12} {'efficiency':>11}"] + [
            f"{name:16} {median(res[name], 'median_step_us') / 1e3:8.1f}ms {median(res[name + ' x2'], 'median_step_us') / 1e3:10.1f}ms "
            f"{eff[name]:11.3f}" for name in ("raw", "ours")] + [
            f"{'ours / raw':16} {'':23} {eff['ours'] / eff['raw']:11.3f}"]

