"""The ranks' agreement to stop, without processes: two StopFlags in lockstep, a shared reduction."""

import signal

from launcher import stopping


class Reduction:
    """MAX across both ranks of what each started in a round; read by each rank one check later."""

    def __init__(self):
        self.rounds = []

    def starter(self, rank):
        count = {"n": 0}

        def start(values):
            n = count["n"]
            count["n"] += 1
            if n == len(self.rounds):
                self.rounds.append({})
            self.rounds[n][rank] = values
            return lambda: [max(v) for v in zip(*self.rounds[n].values())]

        return start


def run(monkeypatch, seconds_per_step, signal_at=None, steps=3000):
    """Both ranks step together; rank r's clock says seconds_per_step[r] per step. Returns the steps
    at which each rank checked, and the step each stopped after (or None)."""
    clock = {"t": 0.0}
    monkeypatch.setattr(stopping.time, "monotonic", lambda: clock["t"])
    flags, reduction = [stopping.StopFlag(ranks=2) for _ in range(2)], Reduction()
    starts = [reduction.starter(r) for r in range(2)]
    checks, stopped = [[], []], [None, None]
    times = [0.0, 0.0]
    for step in range(1, steps + 1):
        if step == signal_at:
            flags[1].signum = signal.SIGTERM  # one rank alone is signalled
        for r in range(2):
            if stopped[r] is not None:
                continue
            times[r] += seconds_per_step[r]
            clock["t"] = times[r]
            before = flags[r].next_check
            result = flags[r].agreed(step, starts[r])
            if before is not None and step >= before:
                checks[r].append(step)
            if result:
                stopped[r] = step
        if all(s is not None for s in stopped):
            break
    return checks, stopped


def test_ranks_check_at_the_same_steps_and_space_checks_by_time(monkeypatch):
    checks, stopped = run(monkeypatch, [0.002, 0.003])  # 2 ms and 3 ms steps: the slower rank's pace wins
    assert checks[0] == checks[1] and stopped == [None, None]
    gaps = [b - a for a, b in zip(checks[0], checks[0][1:])]
    assert gaps[0] == stopping.FIRST_CHECK
    assert gaps[-1] == int(stopping.CHECK_SECONDS / 0.003)  # about CHECK_SECONDS of the slower rank's steps


def test_a_signal_on_one_rank_stops_both_after_the_same_step(monkeypatch):
    checks, stopped = run(monkeypatch, [0.002, 0.002], signal_at=1234)
    assert stopped[0] == stopped[1] is not None
    interval = int(stopping.CHECK_SECONDS / 0.002)
    assert 1234 < stopped[0] <= 1234 + 2 * interval  # within two intervals: about a second


def test_slow_steps_check_every_step(monkeypatch):
    checks, stopped = run(monkeypatch, [2.0, 2.0], signal_at=40, steps=60)
    assert stopped == [41, 41] or stopped == [42, 42]


def test_one_rank_checks_every_step():
    flag = stopping.StopFlag(ranks=1)
    assert flag.agreed(1, None) is None
    flag.signum = signal.SIGINT
    assert flag.agreed(2, None) == signal.SIGINT
