"""Waits that follow the machine's pace. A test's timeout is the seconds its wait needs at most on a quiet 2-core
machine, stretched by how much slower this machine runs now: a fixed timeout that a quiet machine meets with room
is outrun by a busy one (CI's 2-core machine under other jobs ran the suite's processes 3 to 5 times slower:
issue 58), and a wall-clock bound asserted in a test measures the machine, not the code. So tests assert no
wall-clock bound: a hang is caught by a paced timeout, and what a bound really protected (memory, a one-line exit)
is asserted itself."""

import time

WORK = 3_000_000  # iterations of the probe's loop: about QUIET seconds of one core
QUIET = 0.1  # seconds the probe takes on the quiet 2-core machine (Python 3.11; its CPU seconds under load alike)
FRESH = 30.0  # seconds a measurement is reused: the load changes over minutes, and the probe costs QUIET each time

_measured = (-FRESH, 1.0)


def slowdown() -> float:
    """How many times longer than on a quiet machine a fixed piece of this process's work takes now (at least 1):
    the CPU's share this process gets under load and the CPU's own speed together."""
    global _measured
    at, factor = _measured
    if time.monotonic() - at >= FRESH:
        started, x = time.perf_counter(), 0
        for i in range(WORK):
            x += i * i
        factor = max(1.0, (time.perf_counter() - started) / QUIET)
        _measured = (time.monotonic(), factor)
    return factor


def paced(quiet: float) -> float:
    """A timeout of `quiet` seconds on a quiet machine, at this machine's pace now."""
    return quiet * slowdown()


def until(quiet: float) -> float:
    """time.monotonic() at which a wait of `quiet` seconds on a quiet machine has run out here."""
    return time.monotonic() + paced(quiet)
