"""What "the same weights" means in a test, so that it holds on any CPU and on a busy machine (DESIGN.md,
invariant 16).

Two layouts of one training (world sizes, strategies, accumulation splits, pipeline stages, packing) compute
the same sums in another order, so their weights differ by rounding, which training amplifies. In float32 how
far depends on the CPU as much as on the layout: AVX2 and AVX-512 kernels block their sums differently, and
charlm's pp x 2 run against one process (12 steps of SGD) ends 1.6e-6 of its largest weight apart under
AVX-512 and 3.6e-5 under AVX2, on one machine (ATEN_CPU_CAPABILITY=avx2 picks the kernels); another AVX-512
machine measured 5.6e-6. A float32 tolerance is a measurement of the machine it was written on.

So these tests train in float64 (`float64(target)`, tests/float64.py: the model built as the recipe builds it,
then run in float64 throughout), where such runs end at most 2e-14 apart, and `assert_within_rounding`
compares every element of every tensor:

    |a - b| <= steps * 2**16 * u * scale,   u = 2**-53 (float64's unit roundoff), scale = the largest |a|

- Rounding error is relative to the magnitudes summed, not to the result: an element that cancels to near
  zero carries its summands' error. So the bound is in units of the model's largest weight, the same for every
  element, not a fraction of each (an elementwise rtol fails on the small ones; an HF key bias is all small).
- Each step adds its rounding to what the steps before amplified, so the budget grows with the steps: 2**16
  units in the last place a step. Measured over every comparison here, on AVX2 and AVX-512: at most 31 units a
  step in float64 (GPT-2 under AdamW's default eps, whose key bias turns rounding into steps), at most 50 in
  float32 (charlm's pp run above, AVX2). The budget is 2,000 times the worst seen; no CPU's kernel order comes
  near it, and the load on a machine changes no rounding.
- What is not rounding lands far past it: a step missing (4e7 times the bound), another sample order (1e10),
  a mean of micro-batch means (5e8), packed samples that see each other (1e7), and a float32 rounding slipped
  into a float64 run: a gradient reduced in float32 (33 times), a clip norm or item counts in float32 (8,000
  and 250 times), every weight rounded once to float32 (130 times). tests/test_rounding.py shows them caught.

Runs that must stay in float32 (a fused optimizer's kernel: there is no float64 one) compare with
`assert_within_float32_rounding`: `other` ends no farther from the reference's float64 run than SCATTER times
the float32 reference does. That is float32's own rounding of the training, measured on the machine the test
runs on; two float32 runs of one training scatter around the float64 one by 0.8 to 1.3 times each other's
distance in these tests (11 at most in an experiment on charlm's pp runs), so 32 holds, and a step missing
lands 4,000 times away.

Bitwise claims (a resume at the same world size, a run against itself) compare with
tests.conftest.assert_same_weights instead: one machine, one order of sums, no rounding apart."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Mapping, Union

import torch

from tests.float64 import overrides as float64  # noqa: F401  (the overrides of a run compared here)

U = 2.0 ** -53  # float64's unit roundoff
ULPS_A_STEP = 2 ** 16
U32 = 2.0 ** -24  # float32's
SCATTER = 32

Weights = Union[Path, str, Mapping[str, torch.Tensor]]


def bound(reference: Mapping[str, torch.Tensor], steps: int) -> float:
    """How far apart rounding alone leaves two float64 trainings of `steps` steps (the module's docstring)."""
    scale = max((t.abs().max().item() for t in reference.values() if t.is_floating_point() and t.numel()), default=0.0)
    return steps * ULPS_A_STEP * U * scale


def assert_within_rounding(reference: Weights, other: Weights, steps: int) -> None:
    """Every tensor of `other` within rounding of `reference`'s after `steps` optimizer steps, in float64."""
    a, b = _loaded(reference), _loaded(other)
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    wrong = sorted({str(t.dtype) for t in [*a.values(), *b.values()] if t.is_floating_point()} - {"torch.float64"})
    assert not wrong, f"weights in {', '.join(wrong)}: train both in float64 (tests.float64), where rounding " \
                      "does not depend on the CPU"
    limit = bound(a, steps)
    for key in a:
        assert a[key].shape == b[key].shape, f"{key}: shape {tuple(b[key].shape)}, not {tuple(a[key].shape)}"
        if a[key].is_floating_point():
            apart = (a[key] - b[key]).abs().max().item() if a[key].numel() else 0.0
            assert apart <= limit, f"{key} differs by {apart:.3g}, past rounding's {limit:.3g} after {steps} steps"
        else:
            assert torch.equal(a[key], b[key]), f"{key} differs"


def assert_within_float32_rounding(reference: Weights, other: Weights, exact: Weights) -> None:
    """For runs that must stay in float32 (a fused optimizer's kernel has no float64 one): `other` ends no farther
    from `exact`, the reference's training in float64 from the same initial weights, than SCATTER times the float32
    `reference` does. That is float32's own rounding of this training, measured on this machine: no CPU's bound."""
    a, b, t = _loaded(reference), _loaded(other), _loaded(exact)
    assert a.keys() == b.keys() == t.keys(), sorted(set(a) ^ set(b) ^ set(t))
    assert {str(w.dtype) for w in [*a.values(), *b.values()] if w.is_floating_point()} == {"torch.float32"}
    assert {str(w.dtype) for w in t.values() if w.is_floating_point()} == {"torch.float64"}, "exact: not float64"
    scale = max(w.abs().max().item() for w in t.values() if w.is_floating_point() and w.numel())
    rounding = max(_apart(a, t), U32 * scale)
    apart = _apart(b, t)
    assert apart <= SCATTER * rounding, f"{apart:.3g} from the float64 run, past {SCATTER} x float32's rounding " \
                                        f"({rounding:.3g}, the reference's distance from it)"


def _apart(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    """The largest difference of any element of `a`'s floating tensors from `b`'s."""
    floating = [k for k in a if a[k].is_floating_point() and a[k].numel()]
    return max(((a[k].double() - b[k].double()).abs().max().item() for k in floating), default=0.0)


def _loaded(weights: Weights) -> Dict[str, torch.Tensor]:
    if isinstance(weights, Mapping):
        return dict(weights)
    return torch.load(weights, map_location="cpu", weights_only=True)
