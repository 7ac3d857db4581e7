"""What the fault tolerance tests share: python -m launcher.ft in the background with its lines as they come, the
recipe of a short run (its timeouts short: a dead group is noticed in about 2 s on a quiet machine), a group
started again by hand,
and the reference runs under torchrun.

Nothing here waits a fixed time for a run: a run is waited for as long as it says something new (STALL seconds of
silence are a hang), and a group that trains alone holds, after HELD steps, until the lost group is back
(tests/components_ft.py's FT_TEST_HOLD): however long a busy machine takes to start it again, the live groups
neither finish nor outrun it, so the runs are short."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import threading
import time
from typing import List

from tests.conftest import QUICKSTART, REPO

RECIPE = [str(QUICKSTART), "data.train.n=1024", "data.val=null", "data.batch_size=32", "trainer.log_every=1",
          "logging.tensorboard=false", "logging.memory_plan=false", "logging.progress_bar=false"]


def _pg() -> int:
    """timeouts.pg of the test runs: 2 s on a quiet machine, and as much longer as this machine is loaded when the
    tests start (its runnable processes per core: a healthy group's next quorum, or its all-reduce, comes that
    much later), up to 20 s. A shorter pg than the machine's pace drops healthy groups' steps."""
    per_core = os.getloadavg()[0] / max(1, len(os.sched_getaffinity(0)))
    return int(min(20, max(2, 2 * per_core)))


PG = _pg()
QUORUM, JOIN = 5 * PG, 10 * PG
TIMEOUTS = [f"fault_tolerance.timeouts.pg={PG}", f"fault_tolerance.timeouts.quorum={QUORUM}",
            f"fault_tolerance.timeouts.join={JOIN}"]
GROUPS = ["fault_tolerance.groups=2", *TIMEOUTS]  # pg < quorum < join, short
KILLED_AT = random.Random(51).randint(10, 30)  # the step at whose seeded point a group kills itself
STEPS = KILLED_AT + 25  # a killed group's run: HELD steps alone, then the rest with the group back
# 40 ms a step: a test acts between two steps (kills, freezes, signals a group)
PACED = ["step._target_=tests.components_ft.paced_step", "step._partial_=true", "step.seconds=0.04",
         f"trainer.max_steps={STEPS}"]
HELD = 6  # steps a group trains with a group missing before it holds for it
STALL = 600  # seconds without a new line from a run: it hangs


def hold(release=None) -> dict:
    """The environment that makes a group hold for a lost one after HELD steps (until `release` exists, if given)."""
    return {"FT_TEST_HOLD": f"{HELD}" + (f":{release}" if release else "")}


class Run:
    """python -m launcher.ft in the background, its lines collected as they come."""

    def __init__(self, *args: str, env: dict = None):
        # stdout and stderr read apart, line by line: the lighthouse (Rust, in launcher.ft) writes its warnings to
        # stderr itself, and one merged pipe could splice them into a group's line
        self.process = subprocess.Popen([sys.executable, "-m", "launcher.ft", *args], cwd=REPO, text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        env={**without_die(), **(env or {})})
        self.lines: List[str] = []
        self.readers = [threading.Thread(target=self.lines.extend, args=(stream,), daemon=True)
                        for stream in (self.process.stdout, self.process.stderr)]
        for reader in self.readers:
            reader.start()

    @property
    def reading(self):
        """Whether a line may still come."""
        return any(reader.is_alive() for reader in self.readers)

    def wait_for(self, pattern: str) -> re.Match:
        """The first line matching `pattern`, waited for while the run lives and says something new."""
        checked = 0
        for _ in self._progress():
            lines = list(self.lines)
            for line in lines[checked:]:
                found = re.search(pattern, line)
                if found:
                    return found
            checked = len(lines)
            if self.process.poll() is not None and not self.reading:
                raise AssertionError(f"the run ended without a line matching {pattern!r}:\n{self.text()[-3000:]}")

    def finish(self) -> int:
        """Its exit code, once it ends (as long as it says something new)."""
        for _ in self._progress():
            if self.process.poll() is not None:
                for reader in self.readers:
                    reader.join(timeout=STALL)
                return self.process.returncode

    def _progress(self):
        """Every 0.05 s, until STALL seconds pass without a new line."""
        count, since = -1, time.monotonic()
        while True:
            if len(self.lines) != count:
                count, since = len(self.lines), time.monotonic()
            elif time.monotonic() - since > STALL:
                raise AssertionError(f"no new line in {STALL} s:\n{self.text()[-3000:]}")
            yield
            time.sleep(0.05)

    def text(self) -> str:
        return "".join(self.lines)

    def of(self, group: int) -> list:
        return [line[len(f"[group {group}] "):] for line in self.lines if line.startswith(f"[group {group}] ")]


def redone(step: int, text: str) -> bool:
    """Whether the live group said it trains `step` again: dropped in its all-reduce, or started again because the
    step's (optimistic) quorum came without the dead group; which of the two is a race with the death."""
    return bool(re.search(rf"fault tolerance: step {step} (dropped|started again)", text))


def steps(lines: list) -> list:
    return [int(m.group(1)) for line in lines if (m := re.match(r"step (\d+)/\d+ \|", line))]


def without_die() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("FT_TEST_DIE", "FT_TEST_HOLD", "FT_TEST_ROUNDS")}


def ddp(*args: str, processes: int = 2) -> None:
    """The recipe under ddp on `processes` processes, started by torchrun."""
    torchrun(*args, "strategy=ddp", processes=processes)


def torchrun(*args: str, processes: int) -> None:
    """The recipe on `processes` processes, started by torchrun (more of them than this machine's cores too:
    python -m launcher would refuse that)."""
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc_per_node={processes}", "-m", "launcher", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=STALL, env=without_die())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def join(lighthouse: str, run_dir, *overrides: str, group: int = 1, groups: tuple = tuple(GROUPS)) \
        -> subprocess.CompletedProcess:
    """Group `group` started again by hand, joining the run at its lighthouse."""
    return subprocess.run([sys.executable, "-m", "launcher.ft", *RECIPE, *groups, *PACED, f"run_dir={run_dir}",
                           f"fault_tolerance.group={group}", f"fault_tolerance.lighthouse={lighthouse}", *overrides],
                          cwd=REPO, capture_output=True, text=True, timeout=STALL, env=without_die())


def unprefixed(out: str, group: int) -> list:
    """A group's lines as python -m launcher.ft printed them, without its prefix."""
    return re.sub(rf"^\[group {group}\] ", "", out, flags=re.M).splitlines()


def assert_logged_as(reference, ft, rel: float) -> None:
    """What each of two groups logged (`logging.jsonl`) is its own share's: their losses' mean is the reference run's
    loss, and the gradients' norm, taken after the average across groups, is the reference's."""
    def metrics(folder):
        return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]

    import pytest

    logged = [metrics(ft / f"group_{g}") for g in (0, 1)]
    expected = metrics(reference)
    assert [len(m) for m in logged] == [len(expected)] * 2
    for ref, *mine in zip(expected, *logged):
        assert sum(m["train/loss"] for m in mine) / 2 == pytest.approx(ref["train/loss"], rel=rel), ref["step"]
        assert [m["train/grad_norm"] for m in mine] == pytest.approx([ref["train/grad_norm"]] * 2, rel=rel), ref["step"]
