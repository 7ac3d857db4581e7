"""`python -m launcher.bench`: the launcher against a hand-written loop and its peers, a row at a time. The command
and the shared machinery at the top (__main__.py, runs.py, child.py, workload.py; gpu.py with raw_gpt.py, and
checksum.py, commands of their own); each row in a folder with its peer, its __init__ naming its test: loop/,
layouts/, saves/, sft/, dpo/, moe/, ft/, finetune/."""
