"""The comparisons behind every "the same weights" test (tests/rounding.py): they hold for another layout of the
same training, whichever CPU kernels run (tests/test_pipeline.py and the other exactness tests pass under
ATEN_CPU_CAPABILITY=avx2 and the default alike), and still catch what is not rounding: a step missing, another
batch, a float32 rounding inside a float64 run, weights in float32; and a float64 model runs in float64 throughout,
an HF model's casts to float32 included (tests/float64.py)."""

import pytest
import torch

from tests.conftest import train
from tests.float64 import built, in_float64
from tests.rounding import assert_within_float32_rounding, assert_within_rounding, bound, float64

RUN = ["trainer.max_steps=20", "data.batch_size=32"]  # the training compared: in float32 as the quickstart builds it
EXACT = [*float64("recipes.components.mlp.MLP"), *RUN]


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """20 steps of the quickstart in float64, the batch of 32 in one piece."""
    folder = tmp_path_factory.mktemp("whole")
    train(folder, *EXACT)
    return folder / "model.pt"


def test_the_model_trains_in_float64(whole):
    weights = torch.load(whole, weights_only=True)
    assert {w.dtype for w in weights.values()} == {torch.float64}
    model = built("recipes.components.mlp.MLP", hidden=8)
    assert model(torch.zeros(2, 32)).dtype == torch.float64  # its float32 inputs are cast


def test_another_accumulation_split_is_within_rounding(whole, tmp_path):
    train(tmp_path, *EXACT, "data.batch_size=8", "trainer.grad_accum_steps=4")
    assert_within_rounding(whole, tmp_path / "model.pt", steps=20)


def test_a_step_missing_is_caught(whole, tmp_path):
    train(tmp_path, *EXACT, "trainer.max_steps=19")
    with pytest.raises(AssertionError, match="past rounding's"):
        assert_within_rounding(whole, tmp_path / "model.pt", steps=20)


def test_another_batch_is_caught(whole, tmp_path):
    train(tmp_path, *EXACT, "seed=1")  # the same steps over another order of the samples
    with pytest.raises(AssertionError, match="past rounding's"):
        assert_within_rounding(whole, tmp_path / "model.pt", steps=20)


def test_one_float32_rounding_in_a_float64_run_is_caught(whole):
    """What fsdp's reduce in float32 did to a float64 run (2e-7 of the largest weight apart after 12 steps)."""
    weights = torch.load(whole, weights_only=True)
    rounded = {key: w.float().double() for key, w in weights.items()}
    with pytest.raises(AssertionError, match="past rounding's"):
        assert_within_rounding(weights, rounded, steps=40)


def test_float32_weights_are_refused(whole):
    weights = torch.load(whole, weights_only=True)
    with pytest.raises(AssertionError, match="train both in float64"):
        assert_within_rounding({k: w.float() for k, w in weights.items()}, {k: w.float() for k, w in weights.items()},
                               steps=20)


def test_the_bound_is_float64s_rounding_over_the_steps():
    assert bound({"w": torch.tensor([0.5, -2.0], dtype=torch.float64)}, steps=10) == 10 * 2 ** 16 * 2 ** -53 * 2.0


def test_an_hf_model_s_casts_to_float32_stay_in_float64_while_it_runs():
    """LlamaRMSNorm computes in float32 (`hidden_states.to(torch.float32)`): in a float64 model it does not."""
    from tests import hf_zoo

    torch.manual_seed(0)
    norm = in_float64(hf_zoo.llama()).model.norm
    x = torch.randn(4, 32, dtype=torch.float64)
    exact = norm.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    assert (norm(x) - exact).abs().max() < 1e-14  # in float32 it would be ~1e-7 apart
    assert "to" not in vars(torch.Tensor) and "float" not in vars(torch.Tensor)  # torch's own again after the call
    assert x.to(torch.float32).dtype == torch.float32


@pytest.fixture(scope="module")
def in_float32(tmp_path_factory, whole):
    """The whole batch's 20 steps in float32 (from the same initial weights as `whole`, its float64 run)."""
    folder = tmp_path_factory.mktemp("float32")
    train(folder, *RUN)
    return folder / "model.pt"


def test_a_float32_run_s_other_split_is_within_float32_s_own_rounding(whole, in_float32, tmp_path):
    train(tmp_path, *RUN, "data.batch_size=8", "trainer.grad_accum_steps=4")
    assert_within_float32_rounding(in_float32, tmp_path / "model.pt", whole)


def test_a_float32_run_with_a_step_missing_is_caught(whole, in_float32, tmp_path):
    train(tmp_path, *RUN, "trainer.max_steps=19")
    with pytest.raises(AssertionError, match="past 32 x float32's rounding"):
        assert_within_float32_rounding(in_float32, tmp_path / "model.pt", whole)
