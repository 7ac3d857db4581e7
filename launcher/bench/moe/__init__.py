"""The MoE row (--moe): row.py (ep x2 against fsdp x2 alone on the CPU) and gpu.py (bench.gpu --moe: the same on
N GPUs, and the all-to-all's share). Tested by tests/test_bench_moe.py."""
