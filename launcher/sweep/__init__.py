"""Sweeps: a grid of overrides, one run folder per combination, run on this machine (queued over its GPUs) or
as a Slurm job array, and one table of their results read from what the runs write (python -m launcher.sweep)."""
