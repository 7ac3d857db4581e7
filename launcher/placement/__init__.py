"""Where the ranks go and how their processes start. `scheduler` is a pure function from the environment
(torchrun, Slurm, accelerate, a plain process) and the visible GPUs to a `Placement`; `spawn` starts
torchrun in-process for `strategy: ddp` (and the other multi-process strategies) typed without it."""
