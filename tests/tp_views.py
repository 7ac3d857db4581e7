"""Under tp x 2 (torchrun, gloo): a tiny Qwen3 split by its own plan and wrapped whole by FSDP2 returns its logits as
a view, and torch refuses an in-place op on them; each rank writes what it saw to FOLDER/rank<R>.txt
(tests/test_tp_norms.py reads them).

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/tp_views.py FOLDER"""

import os
import sys
from pathlib import Path

sys.path.insert(0, os.getcwd())  # run as a script from the repository's root

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

from launcher.parallel import plans  # noqa: E402
from tests.hf_zoo import qwen3  # noqa: E402

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp_shard", "tp"))
model = qwen3()
plans.apply(model, mesh["tp"], "auto")
fully_shard(model, mesh=mesh["dp_shard"])
logits = model(input_ids=torch.arange(8).view(1, 8)).logits
try:
    logits += 1
    saw = "in-place: allowed"
except RuntimeError as e:
    saw = f"view: {logits._base is not None}; in-place: {str(e).splitlines()[0]}"
Path(sys.argv[1], f"rank{dist.get_rank()}.txt").write_text(saw)
dist.destroy_process_group()
os._exit(0)  # gloo's threads can abort a rank in the interpreter's finalization (launcher/__main__.py says so)
