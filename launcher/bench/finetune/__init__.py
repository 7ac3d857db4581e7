"""The GPU fine-tuning rows of bench.gpu: row.py (--finetune: a 1B Llama-shaped model by recipes/hf_finetune.yaml
under fsdp), its peer peer.py (HF Trainer on the same folder), fp8.py (--fp8: the same with precision=fp8 against
bf16). Tested by tests/test_bench.py (the fine-tuning row, tiny on the CPU)."""
