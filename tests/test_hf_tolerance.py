"""docs/launching.md's claim of how close two processes end to one, tested on real HF models built from their
configs (tests/hf_zoo.py), in float64 (tests/float64.py), where the claim holds on any CPU: every case ends within
rounding of one process (tests/rounding.py), with SGD and with AdamW, the ones whose float32 runs drift apart
included (T5's ReLU, the attention key bias under Adam's default eps). How far their float32 runs drift is what
`python -m tests.hf_tolerance` measures. The two-process runs of every case share one torchrun launch
(tests/several_runs.py)."""

import pytest
import torch

from tests.hf_tolerance import RECIPE, TP_PLANS, in_process, overrides
from tests.rounding import assert_within_rounding, float64

transformers = pytest.importorskip("transformers", reason="the dev extra (transformers) is not installed")
pytestmark = pytest.mark.slow

CASES = [
    ("bert", "sgd", "ddp"), ("gpt2", "sgd", "fsdp"), ("t5", "sgd", "fsdp"), ("vit", "sgd", "fsdp"),
    ("t5", "adamw", "ddp"), ("vit", "adamw-eps1e-5", "fsdp"), ("bert", "adamw-eps1e-5", "ddp"),
    ("bert", "sgd", "tp"),  # tensor parallel x2, by the plan tests/hf_tolerance.py writes for BERT
    ("gpt2", "adamw", "ddp"), ("t5", "adamw", "fsdp"),  # in float32: the key bias, and ReLU under Adam, drift
]


def name(model: str, optimizer: str, strategy: str) -> str:
    return f"{model}-{optimizer}-{strategy}"


def exact(model: str, optimizer: str) -> list:
    return [*overrides(model, optimizer), *float64(f"tests.hf_zoo.{model}")]


def layout(model: str, strategy: str) -> list:
    if strategy == "tp":
        return ["strategy=fsdp", "parallel.tp=2", f"parallel.tp_plan={TP_PLANS[model]}"]
    return [f"strategy={strategy}"]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """Every case's run under two processes, one after another in one torchrun launch: (folder, rank 0's results)."""
    from tests.several_runs import several

    root = tmp_path_factory.mktemp("tolerance")
    cases = {name(*case): [str(RECIPE), f"run_dir={root / name(*case)}", *exact(*case[:2]), *layout(case[0], case[2])]
             for case in CASES}
    return root, several(cases, root, timeout=600)[0]


@pytest.mark.parametrize("model, optimizer, strategy", CASES)
def test_two_processes_end_within_rounding_of_one(model, optimizer, strategy, tmp_path, two_processes):
    root, results = two_processes
    done = results[name(model, optimizer, strategy)]
    assert done["error"] is None, done
    assert strategy != "tp" or "parallel.tp: 12 layers split over 2 ranks" in done["said"], done["said"]
    in_process(tmp_path / "one", exact(model, optimizer))
    one = torch.load(tmp_path / "one" / "model.pt", weights_only=True)
    two = torch.load(root / name(model, optimizer, strategy) / "model.pt", weights_only=True)
    assert_within_rounding(one, two, steps=6)
