"""The layouts row of python -m launcher.bench: charlm at a CPU size under ddp x2, fsdp x2, tp x2 (the recipe's
plan), pp x2 (1F1B, its head untied), fsdp x2 by tp x2, HSDP 2 x 2 and pp x2 by fsdp x2 (torchrun, gloo): the
bytes one rank holds in parameters, gradients and optimizer state at the end (of a shard, its local part; of
a pipeline, rank 0's: the first stage's), and the step time against ddp x2.

The two-process layouts alternate `--reps` times and their step times are compared with ddp x2's, reported
and not judged: on the CPU, gloo's collectives are slow, and tensor parallelism adds two all-reduces per
block to every forward and backward, so it is expected to cost more than DDP here; its worth is layers too
wide for one GPU. The four-process layouts run once, for their memory: four processes on two cores time
nothing useful."""

from __future__ import annotations

import statistics

from launcher.bench.runs import PY, alternate, median

RECIPE = ["recipes/charlm.yaml", "on_cpu=null", "devices=cpu", "precision=fp32", "model.n_layer=4", "model.n_head=4",
          "model.n_embd=128", "model.block_size=64", "model.dropout=0.0", "data.batch_size=16", "data.val=null",
          "metrics={}", "trainer.log_every=100", "trainer.eval_every=null", "checkpoint.every=null",
          "checkpoint.resume=never", "logging.tensorboard=false", "logging.progress_bar=false"]
PP = ["strategy=fsdp", "parallel.pp=2", "model.tie_weights=false"]  # stages need the head untied: 0.03 MiB more
TWO = {"ddp x2": ["strategy=ddp"], "fsdp x2": ["strategy=fsdp"], "tp x2": ["strategy=fsdp", "parallel.tp=2"],
       "pp x2": PP}
FOUR = {"fsdp x2 tp x2": ["strategy=fsdp", "parallel.tp=2"], "hsdp 2x2": ["strategy=fsdp", "parallel.dp_replicate=2"],
        "pp x2 fsdp x2": PP}
KINDS = ("parameters", "gradients", "optimizer state")


def torchrun(processes: int):
    return [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]


def layouts(args) -> list[str]:
    steps = str(args.fsdp_steps)
    recipe = [*RECIPE, f"trainer.max_steps={steps}"]

    def sides(table: dict, processes: int) -> dict:
        return {name: ([*torchrun(processes), "-m", "launcher.bench.child", *recipe, *how,
                        f"run_dir={args.run_dir}/{name.replace(' ', '_')}"], {}) for name, how in table.items()}

    four = alternate(sides(FOUR, 4), 1) if args.layouts == "all" else {}
    res = {**alternate(sides(TWO, 2), args.reps), **four}
    held = {name: {k: median(runs, k) for k in KINDS} for name, runs in res.items()}
    total = {name: sum(h.values()) for name, h in held.items()}
    mib = lambda b: f"{b / 2**20:.2f}MiB"  # noqa: E731

    def step_time(name: str) -> str:
        if name in FOUR:
            return "(4 processes: memory only)"
        r = [a["median_step_us"] / b["median_step_us"] for a, b in zip(res[name], res["ddp x2"])]
        return f"{statistics.median(r):.3f} ({min(r):.3f}-{max(r):.3f})"

    share = total["fsdp x2"] / total["ddp x2"]
    fsdp_time = step_time("fsdp x2").split()[0]
    return [f"layouts (gloo), charlm 4x128 (its Blocks as units; tp: the recipe's plan), {steps} steps, {args.reps} "
            f"alternating repetitions (python -m launcher.bench --fsdp-steps {steps} --reps {args.reps})",
            f"{'':16} {'parameters':>11} {'gradients':>10} {'optimizer':>10} {'per rank':>10}  step time / ddp x2"] + [
            f"{name:16} {mib(h['parameters']):>11} {mib(h['gradients']):>10} {mib(h['optimizer state']):>10} "
            f"{mib(total[name]):>10}  {step_time(name)}" for name, h in held.items()] + [
            f"{'fsdp / ddp':16} held per rank {share:.3f} (target <= 0.525: {'met' if share <= 0.525 else 'NOT met'}); "
            f"step time {fsdp_time} "]
