"""The gradients' average across replica groups (launcher/ft/average.py), in one process: its buckets, when the
backward launches them, their order, and the process group chosen by the device. The averages' values against
ddp are checked with real groups (test_ft.py, test_ft_sharded.py)."""

from typing import List

import pytest
import torch
from torch import nn

from launcher.ft import average

pytest.importorskip("torchft", reason="torchft's wheels are Linux x86-64 only (the dev extra installs it there)")


LAYER = (256 * 256 + 256) * 4  # bytes of a Linear(256, 256)'s weight and bias


class Recorded:
    """An all-reduce that averages with a second group whose gradients are `other` times this one's, and records
    each launch: the bucket's size and which parameters had a gradient then."""

    def __init__(self, model: nn.Module, other: float = 3.0):
        self.model, self.other = model, other
        self.launches: List[tuple] = []

    def __call__(self, flat: torch.Tensor) -> "Recorded":
        self.launches.append((flat.numel(), [q.grad is not None for q in self.model.parameters()]))
        flat.mul_((1 + self.other) / 2)
        return self

    def wait(self) -> None:  # (torchft's work: done at once here)
        pass

    def sizes(self) -> List[int]:
        return [n for n, _ in self.launches]


def _model(width: int = 256, layers: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def test_buckets_take_the_parameters_in_reverse_order_a_small_first_then_ddps_cap_one_dtype_each():
    params = [torch.zeros(2**18), torch.zeros(2**18), torch.zeros(2**18, dtype=torch.float64), torch.zeros(10),
              torch.zeros(2**20), torch.zeros(2**20)]  # 1 MiB, 1 MiB, 2 MiB, 40 B, 4 MiB, 4 MiB
    made = average.buckets(params, first=2**20, cap=6 * 2**20)
    assert [[next(i for i, p in enumerate(params) if p is q) for q in b.params] for b in made] == [
        [5], [4, 3], [2], [1, 0]]  # 4 MiB alone is past the first's 1 MiB; a dtype change cuts; 2 MiB fits 6 MiB


def test_a_group_of_one_process_launches_each_bucket_during_the_backward_and_every_group_in_the_same_order():
    model = _model()
    params = list(model.parameters())
    done = Recorded(model)
    averaging = average.Average(params, done, overlap=True, first=LAYER, cap=LAYER)  # a layer a bucket
    averaging.arm()
    model(torch.randn(8, 256)).sum().backward()
    # the last layer's bucket went while the first layer's gradients were not made yet: overlapped
    assert len(done.launches) == 4
    assert done.launches[0][1] == [False, False, False, False, False, False, True, True]
    expected = [q.grad.clone() * 2 for q in params]  # this group's gradient and the other's, 3 times it, averaged
    averaging.wait()
    for q, want in zip(params, expected):
        assert torch.equal(q.grad, want)


def test_a_micro_batch_before_the_last_launches_nothing_and_the_last_averages_the_accumulated_gradients():
    model = _model(layers=2)
    params = list(model.parameters())
    done = Recorded(model)
    averaging = average.Average(params, done, overlap=True)
    model(torch.randn(8, 256)).sum().backward()  # an accumulation micro-step: not armed
    assert done.launches == []
    averaging.arm()
    model(torch.randn(8, 256)).sum().backward()
    accumulated = [q.grad.clone() for q in params]
    averaging.wait()
    assert len(done.launches) == 1  # both layers fit DDP's first bucket
    assert all(torch.equal(q.grad, g * 2) for q, g in zip(params, accumulated))


def test_a_parameter_without_a_gradient_holds_back_its_bucket_and_those_after_it_until_wait_in_order():
    model = _model(layers=3)
    params = list(model.parameters())
    done = Recorded(model)
    averaging = average.Average(params, done, overlap=True, first=LAYER, cap=LAYER)
    averaging.arm()
    hidden = model[0](torch.randn(8, 256))
    model[2](hidden).sum().backward()  # the middle layer unused: its bucket (the 2nd) and the 3rd wait
    assert done.sizes() == [256 * 256 + 256]
    averaging.wait()
    assert done.sizes() == [256 * 256 + 256] * 3  # the same three all-reduces, in the same order, as a group that used it
    assert torch.equal(model[1].weight.grad, torch.zeros(256, 256))


def test_several_processes_a_group_launch_every_bucket_after_the_backward():
    model = _model(layers=2)
    done = Recorded(model)
    averaging = average.Average(list(model.parameters()), done, overlap=False)
    averaging.arm()
    model(torch.randn(8, 256)).sum().backward()  # a group's own reduction (ddp's, fsdp's) is not done yet here
    assert done.sizes() == []
    averaging.wait()
    assert done.sizes() == [2 * (256 * 256 + 256)]


def test_the_groups_average_through_torchfts_nccl_on_cuda_and_gloo_on_the_cpu():
    import torchft

    from launcher.ft.pieces import process_group

    assert process_group("cuda") is torchft.ProcessGroupNCCL  # (not run on a GPU here)
    assert process_group("cpu") is torchft.ProcessGroupGloo
