"""The SFT row (--sft; bench.gpu --sft): row.py (recipes/hf_sft.yaml, padded against packed) and its peer, peer.py
(TRL's SFTTrainer packing the same samples). Tested by tests/test_bench.py (the SFT rows)."""
