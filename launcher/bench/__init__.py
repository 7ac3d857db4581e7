"""`python -m launcher.bench`: the reference workload through a recipe against a hand-written loop."""
