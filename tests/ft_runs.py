"""What the fault tolerance tests share: python -m launcher.ft in the background with its lines as they come, the
recipe of a short run (its timeouts short: a dead group is noticed in about 2 s), a group started again by hand,
and the reference runs under torchrun."""

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
TIMEOUTS = ["fault_tolerance.timeouts.pg=2", "fault_tolerance.timeouts.quorum=10", "fault_tolerance.timeouts.join=20"]
GROUPS = ["fault_tolerance.groups=2", *TIMEOUTS]  # pg < quorum < join, short
# 40 ms a step: the surviving groups train alone for as long as the killed one takes to start again (a few
# seconds on a busy machine) and still have steps left to train with it
PACED = ["step._target_=tests.components_ft.paced_step", "step._partial_=true", "step.seconds=0.04",
         "trainer.max_steps=400"]
KILLED_AT = random.Random(51).randint(10, 30)  # the step at whose seeded point a group kills itself


class Run:
    """python -m launcher.ft in the background, its lines collected as they come."""

    def __init__(self, *args: str, env: dict = None):
        self.process = subprocess.Popen([sys.executable, "-m", "launcher.ft", *args], cwd=REPO, text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        env={**without_die(), **(env or {})})
        self.lines: List[str] = []
        self.reading = threading.Thread(target=lambda: self.lines.extend(self.process.stdout), daemon=True)
        self.reading.start()

    def wait_for(self, pattern: str, timeout: float = 120) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                found = re.search(pattern, line)
                if found:
                    return found
            assert self.process.poll() is None or self.reading.is_alive(), self.text()[-3000:]
            time.sleep(0.05)
        raise AssertionError(f"no line matching {pattern!r} in {timeout} s:\n{self.text()[-3000:]}")

    def finish(self, timeout: float = 180) -> int:
        code = self.process.wait(timeout=timeout)
        self.reading.join(timeout=10)
        return code

    def text(self) -> str:
        return "".join(self.lines)

    def of(self, group: int) -> list:
        return [line[len(f"[group {group}] "):] for line in self.lines if line.startswith(f"[group {group}] ")]


def steps(lines: list) -> list:
    return [int(m.group(1)) for line in lines if (m := re.match(r"step (\d+)/\d+ \|", line))]


def without_die() -> dict:
    return {k: v for k, v in os.environ.items() if k != "FT_TEST_DIE"}


def ddp(*args: str, processes: int = 2) -> None:
    """The recipe under ddp on `processes` processes, started by torchrun."""
    torchrun(*args, "strategy=ddp", processes=processes)


def torchrun(*args: str, processes: int) -> None:
    """The recipe on `processes` processes, started by torchrun (more of them than this machine's cores too:
    python -m launcher would refuse that)."""
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc_per_node={processes}", "-m", "launcher", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=180, env=without_die())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def join(lighthouse: str, run_dir, *overrides: str, group: int = 1, groups: tuple = tuple(GROUPS)) \
        -> subprocess.CompletedProcess:
    """Group `group` started again by hand, joining the run at its lighthouse."""
    return subprocess.run([sys.executable, "-m", "launcher.ft", *RECIPE, *groups, *PACED, f"run_dir={run_dir}",
                           f"fault_tolerance.group={group}", f"fault_tolerance.lighthouse={lighthouse}", *overrides],
                          cwd=REPO, capture_output=True, text=True, timeout=180, env=without_die())


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
