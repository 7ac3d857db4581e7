"""The benchmark runs and prints its table (the figures themselves are for the README, not asserted)."""

import subprocess
import sys

from tests.conftest import REPO


def test_benchmark_prints_ratios():
    done = subprocess.run([sys.executable, "-m", "launcher.bench", "--steps", "120", "--reps", "1", "--no-ddp"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    row = [l for l in done.stdout.splitlines() if l.startswith("1 process")]
    assert len(row) == 1 and "us" in row[0] and "MiB" in row[0]
    ratio = float(row[0].split()[4])
    assert 0.2 < ratio < 5  # a sanity bound on what was measured, not a speed target
