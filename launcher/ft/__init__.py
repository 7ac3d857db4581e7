"""Fault tolerance: replica groups that train on when one of them dies, and take it back live (torchft).

    settings.py     which group this is, the lighthouse, each group's share of a batch, the recipe's fingerprint
    recovery.py     the state a live group hands to one that joins, and how it is taken (no checkpoint read)
    same_recipe.py  every member of a new quorum checked against the live groups' recipe, before anything is averaged
    replicas.py     torchft's Manager, step by step: the quorum, the gradients' average, the commit
    rounds.py       the step's quorum: optimistic, during the step; synchronous only where the groups changed
    average.py      that average in buckets, launched as the backward makes them (as DDP's)
    lighthouse.py   torchft's lighthouse, in this process
    pieces.py       torchft's logging kept quiet, its process group for a device, its transfer of a live copy
    leaving.py      a group that loses one of its processes leaves the run at once
    groups.py       every group of a run started on this machine, their output prefixed, one exit code
    __main__.py     python -m launcher.ft RECIPE [key=value ...]

The strategies import this package only when a recipe has a `fault_tolerance:` section
(launcher/strategies/fault_tolerant.py); torchft is imported by replicas.py, pieces.py and lighthouse.py alone.
"""
