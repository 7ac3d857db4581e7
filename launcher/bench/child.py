"""The launcher side: `python -m launcher ...` with a StepClock ticking at the end of every optimizer
step (the same instrumentation as the hand-written loop's)."""

import sys

from launcher.bench.workload import StepClock
from launcher.cli import main
from launcher.metrics import TrainMeter


def run(argv) -> int:
    clock = StepClock()
    step_done = TrainMeter.step_done

    def ticking(self, grad_norm):
        step_done(self, grad_norm)
        clock.tick()

    TrainMeter.step_done = ticking
    code = main(argv)
    import os

    if os.environ.get("RANK", "0") == "0":
        clock.report()
    return code


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
