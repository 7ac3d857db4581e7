"""The launcher's loop against a hand-written one, step by step: rows.py (the reference workload at 1 process and
DDP x2, the HF model, the loggers, scaling from 1 to 2 processes), the hand-written loops beside it (raw.py, and
raw_hf.py for the HF model), its peers (peer_accelerate.py, peer_lightning.py, peer_trainer.py: HF Trainer);
startup.py (a one-step run as a user types it, against raw.py's) and defaults.py (each default the launcher picks,
on against off). Tested by tests/test_bench.py: the reference workload, the loggers, defaults and start-up, and
the HF, fsdp and scaling rows."""
