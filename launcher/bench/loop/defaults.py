"""The defaults row of python -m launcher.bench (`--defaults` prints it alone): each default the launcher
picks for its users, measured alone, the run at the default against the same run with it turned off (or
at torch's), both through the launcher, alternating, in fresh processes. A ratio below 1 is the default
helping. The mean step is timed, so that what happens once an epoch (loader workers started) counts.

- the optimizer's fused implementation, on the HF recipe and on the reference workload;
- loader workers kept between epochs and evaluations (`data.persistent_workers`), with 2 workers, on the
  quickstart recipe, whose epochs are 128 steps (`--epoch-steps N`: N, its samples cut to N batches, so that a short
  run crosses epochs too);
- what each worker makes ahead: torch's 2 against 4 (`data.prefetch_factor`), the same run.

pin_memory and TF32 act on a GPU alone: `python -m launcher.bench.gpu --tf32` measures TF32."""

from __future__ import annotations

import statistics


def defaults(args, alternate, py: str) -> list[str]:
    hf = ["recipes/hf_causal_lm.yaml", f"trainer.max_steps={args.hf_steps}", "trainer.log_every=100",
          "trainer.eval_every=null", "data.val=null", "metrics={}", "checkpoint.every=null", "checkpoint.resume=never",
          "logging.tensorboard=false", "logging.progress_bar=false", "devices=cpu"]
    reference = ["recipes/bench.yaml", f"trainer.max_steps={args.steps}"]
    workers = ["recipes/quickstart.yaml", f"trainer.max_steps={args.steps}", "trainer.log_every=100",
               "trainer.eval_every=null", "data.val=null", "metrics={}", "checkpoint.every=null",
               "checkpoint.resume=never", "logging.tensorboard=false", "logging.progress_bar=false", "devices=cpu",
               "data.num_workers=2", *([f"data.train.n={64 * args.epoch_steps}"] if args.epoch_steps else [])]
    cases = [  # (what, recipe, the default's overrides, the other side's, what the other side is)
        ("optimizer fused, HF recipe", hf, [], ["optimizer.fused=false"], "torch's default"),
        ("optimizer fused, reference", reference, ["optimizer.fused=true"], ["optimizer.fused=false"], "torch's default"),
        ("persistent workers (2)", workers, [], ["data.persistent_workers=false"], "started each epoch"),
        ("prefetch_factor 2 (torch's)", workers, [], ["data.prefetch_factor=4"], "4"),
    ]
    out = [f"defaults, each alone: the launcher's default against the same run without it, {args.reps} alternating "
           f"repetitions (python -m launcher.bench --defaults --steps {args.steps} --hf-steps {args.hf_steps} "
           f"--reps {args.reps}{f' --epoch-steps {args.epoch_steps}' if args.epoch_steps else ''})",
           f"{'':30} {'default':>10} {'other':>10}  {'default / other (range)':<24} other"]
    for what, recipe, on, off, other in cases:
        sides = {side: ([py, "-m", "launcher.bench.child", *recipe, *extra, f"run_dir={args.run_dir}/defaults-{side}"],
                        {}) for side, extra in (("on", on), ("off", off))}
        res = alternate(sides, args.reps)
        r = [a["mean_step_us"] / b["mean_step_us"] for a, b in zip(res["on"], res["off"])]
        mean = {side: statistics.median(run["mean_step_us"] for run in res[side]) for side in res}
        out.append(f"{what:30} {mean['on']:8.0f}us {mean['off']:8.0f}us  {statistics.median(r):5.3f} "
                   f"({min(r):.3f}-{max(r):.3f})          {other}")
    return out
