"""The pipeline row of python -m launcher.bench (--pipeline): charlm at a CPU size, 8 blocks with its head untied,
under pp x2 with each schedule (torchrun, gloo, two ranks on two cores) against one process training the whole
model on the same micro-batches (accumulated: the same rows in each matmul as a stage's): the step time, and
each schedule's bubble, measured and in theory.

Measured bubble: the share of a pipelined step in which a stage does not compute, against one process's work
split evenly over the stages: 1 - (one process's step / pp) / (the pipelined step). It holds the bubble and
what else a pipeline costs here (the sends, the schedule's own work, the first and last stages' embeddings and
head, which make them heavier than the middle). In theory, p stages, m micro-batches, v stages a rank: GPipe
and 1F1B idle (p - 1) / (m + p - 1) of a step, the looped and interleaved schedules (p - 1) / (v m + p - 1);
the zero-bubble schedules fill it with the weight gradients' half of the backward (none left, in theory, once
m >= 2p)."""

from __future__ import annotations

from launcher.bench.layouts.row import RECIPE as LAYOUTS, torchrun
from launcher.bench.runs import PY, alternate, median

BATCH = 32
RECIPE = [*LAYOUTS, "model.n_layer=8", "model.tie_weights=false", f"data.batch_size={BATCH}"]
SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "looped_bfs": 2, "interleaved_zb": 2, "zbv": 2}
PP, MICRO = 2, 8


def theory(schedule: str, p: int, m: int, v: int) -> float:
    if schedule in ("interleaved_zb", "zbv"):
        return 0.0
    return (p - 1) / ((m if v == 1 else v * m) + p - 1)


def pipeline(args) -> list[str]:
    steps = str(args.pipeline_steps)
    recipe = [*RECIPE, f"trainer.max_steps={steps}", f"parallel.microbatches={MICRO}"]
    # one process on micro-batches of the same rows (accumulated): what each stage's matmuls would take alone
    sides = {"one process": ([PY, "-m", "launcher.bench.child", *recipe, "strategy=single",
                              f"data.batch_size={BATCH // MICRO}", f"trainer.grad_accum_steps={MICRO}",
                              f"run_dir={args.run_dir}/pp_one"], {})}
    chosen = [name for name in args.pipeline_schedules.split(",") if name]
    unknown = [name for name in chosen if name not in SCHEDULES]
    if unknown:
        raise SystemExit(f"--pipeline-schedules: {unknown[0]} is not one of {', '.join(SCHEDULES)}")
    for name in chosen:
        sides[name] = ([*torchrun(PP), "-m", "launcher.bench.child", *recipe, "strategy=fsdp", f"parallel.pp={PP}",
                        f"parallel.pp_schedule={name}", f"run_dir={args.run_dir}/pp_{name}"], {})
    res = alternate(sides, args.reps)
    one = median(res["one process"], "median_step_us")
    lines = [f"pipeline (gloo, pp {PP}, {MICRO} micro-batches), charlm 8x128 (head untied), batch {BATCH}, {steps} steps, "
             f"{args.reps} alternating repetitions (python -m launcher.bench --pipeline --pipeline-steps {steps} "
             f"--reps {args.reps}" + ("" if len(chosen) == len(SCHEDULES) else f" --pipeline-schedules "
                                     f"{','.join(chosen)}") + ")",
             f"{'':18} {'stages/rank':>11} {'step ms':>8} {'/ one':>6} {'bubble measured':>16} {'in theory':>10}",
             f"{'one process':18} {'':>11} {one / 1e3:8.2f} {1:6.3f} {'':>16} {'':>10}  (the same micro-batches, "
             f"accumulated)"]
    for name in chosen:
        v, step = SCHEDULES[name], median(res[name], "median_step_us")
        bubble = 1 - (one / PP) / step
        lines.append(f"{name:18} {v:>11} {step / 1e3:8.2f} {step / one:6.3f} {bubble:16.3f} "
                     f"{theory(name, PP, MICRO, v):10.3f}")
    return lines
