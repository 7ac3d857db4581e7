"""Slurm: render an sbatch script from a template in slurm/ and typed options, and submit it."""
