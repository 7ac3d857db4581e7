"""The DPO row (--dpo): row.py (recipes/hf_dpo.yaml) and its peer, peer.py (TRL's DPOTrainer on the same folder and
pairs). Tested by tests/test_bench_dpo.py."""
