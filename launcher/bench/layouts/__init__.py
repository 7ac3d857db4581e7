"""The rows of parallel layouts: row.py (charlm under ddp, fsdp, tp, pp, HSDP: the bytes one rank holds),
pipeline.py (pp x2 by schedule against one process on the same micro-batches), pretrained.py (host memory per rank
to load an HF folder under fsdp x2, each rank its slices against every rank the whole). Tested by
tests/test_bench.py (the HF, fsdp and scaling rows; the pipeline row) and tests/test_hf_folders.py (pretrained)."""
