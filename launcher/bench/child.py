"""The launcher side: `python -m launcher ...` with a StepClock ticking at the end of every optimizer
step (the same instrumentation as the hand-written loop's). With BENCH_FETCH=per-item, an in-memory
TensorDataset is fetched item by item and collated, as the hand-written loop's DataLoader does, so
that the loop's own cost shows apart from the gain of batched fetching. The report also gives the
bytes this rank holds in parameters, gradients and optimizer state at the end of training (of a
sharded tensor, this rank's shard).

The run's memory planner (logging.memory_plan: python -m launcher.plan, a process of its own beside rank 0,
and torch's memory tracker around one step) is off here: these rows time the loop, and on a machine of two
cores that process would take the core the measured run shares with nothing on the hand-written side. The
start-up row runs `python -m launcher` itself, as a user types it, the planner included."""

import os
import sys

import launcher.run.train
from launcher.data import sampling as data
from launcher.observe import holdings
from launcher.bench.workload import StepClock, finish
from launcher.cli import main
from launcher.run.metrics import TrainMeter


def run(argv) -> int:
    clock = StepClock()
    step_done = TrainMeter.step_done

    def ticking(self, grad_norm, *share):  # (the share of the batch trained: fault tolerance's live groups)
        step_done(self, grad_norm, *share)
        clock.tick()

    TrainMeter.step_done = ticking
    fit, held = launcher.run.train.fit, {}

    def measured(parts, *args):
        out = fit(parts, *args)
        held.update(holdings.held(parts.model, parts.optimizer), loss=out.get("train/loss"))
        return out

    launcher.run.train.fit = measured
    if os.environ.get("BENCH_FETCH") == "per-item":
        data.TensorBatches = lambda dataset: dataset
    code = main([*argv, "logging.memory_plan=false"])
    if os.environ.get("RANK", "0") == "0":
        clock.report(**held)
    return code


if __name__ == "__main__":
    finish(run(sys.argv[1:]))
