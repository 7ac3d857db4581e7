"""Expert parallelism: each mixture-of-experts layer's experts split over the `ep` ranks of an ep group, the
tokens sent to their experts' ranks and back by all-to-all (torchtitan's and Megatron's EP).

An experts module is recognised by the interface transformers 5's MoE models share (Qwen3-MoE, Mixtral,
gpt-oss, DeepSeek-V3, ...), not by its class: an int `num_experts`; parameters all indexed by expert first
(`gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I], gpt-oss's transposed weights and biases too), among them a
3-D `down_proj`; and `forward(hidden_states, top_k_index, top_k_weights)` on the flattened tokens [T, H], each
token's K experts [T, K] and their weights [T, K]. Its code is not changed: `split` makes each of those
parameters a DTensor sharded by expert over the ep mesh (Shard(0): rank r holds experts r*E/ep to (r+1)*E/ep - 1,
as the whole tensor's rows, so DCP and a full state dict see the whole [E, ...] tensor), and replaces the
module's forward (on the instance) by `dispatched`:

1. The (token, slot) pairs sorted by expert (stably: the slots of one token keep their order), which groups
   them by the rank that holds the expert; how many go to each rank is exchanged first (all_to_all_single of
   ep counts, read on the host: the split sizes of the next all-to-all; HF's own eager experts read their
   hit experts on the host too).
2. Each pair's hidden state sent to its expert's rank (an all-to-all with autograd: its backward sends the
   gradients back), with the expert's index among that rank's.
3. The module's own forward, as written, on what the rank received: each row a token of one slot, weight 1,
   seen through a view of the module whose parameters are the rank's local slices and whose `num_experts` is
   the rank's count. Its eager loop and transformers' grouped kernels both run unchanged.
4. The results sent back (all-to-all), put back in (token, slot) order, weighted by the router's weights and
   summed over the slots: the same products and sums as one process's forward, in another order.

The ranks of an ep group read different tokens (they are data-parallel ranks, each loss a mean over its own
share), so the gradient each rank's slice gets in backward is a sum over the ep group's losses: the view of the
weights scales it by 1/ep, to their mean. The strategy shards each experts module on its own over the ranks
that hold the same experts (dp_shard / ep, and dp_replicate: the data-parallel ranks / ep), and FSDP's average
over them makes it the mean over every data-parallel rank, as the dense parts' is: one process's gradient.
(Not FSDP's own gradient_divide_factor: torch 2.13 divides twice by it where the experts' shards are one
rank's, in float64 or with a plain sum forced, as gloo needs.)
A rank whose experts got no token in a step still gets a gradient (of zeros), as one process's unused
experts do: an optimizer that steps on zeros (momentum, weight decay) steps them alike, and every rank of
the reduction takes part in it. Under tp each rank of a tp group does all this over its own ep group (the ranks of
its tp rank) for the same tokens, its experts whole (launcher/parallel/mesh.py says why)."""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any, Dict, List, Tuple

import torch
from torch import nn

from launcher.errors import UserError

# each dispatch's (pairs this rank sent, pairs it received) told to this: the run's memory check, which plans
# the routing its measured step had (launcher/run/planning.py)
routed_to: Any = None
EXPECTED = ("an HF mixture of experts' experts: an int num_experts, parameters indexed by expert first "
            "(gate_up_proj, down_proj), forward(hidden_states, top_k_index, top_k_weights)")


def found(model: nn.Module) -> Dict[str, nn.Module]:
    """The model's experts modules, by name (see the module's docstring)."""
    return {name: module for name, module in model.named_modules() if is_experts(module)}


def is_experts(module: nn.Module) -> bool:
    count = getattr(module, "num_experts", None)
    own = dict(module.named_parameters(recurse=False))
    down = own.get("down_proj")
    if not isinstance(count, int) or isinstance(count, bool) or count < 1 or down is None or down.dim() != 3:
        return False
    if any(p.dim() < 1 or p.shape[0] != count for p in own.values()):
        return False
    if any(True for child in module.children() for _ in child.parameters()):
        return False  # weights outside the expert-indexed tensors: not this interface
    try:
        params = list(inspect.signature(type(module).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    return len([p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]) >= 3


def problems(model: nn.Module, ep: int) -> List[str]:
    """What stops the experts splitting over `ep` ranks, one line each; empty when they split."""
    modules = found(model)
    if not modules:
        return [f"parallel.ep: the model ({type(model).__name__}) has no experts module this launcher can split "
                f"({EXPECTED}); set parallel.ep=1"]
    uneven = {name: module.num_experts for name, module in modules.items() if module.num_experts % ep}
    if not uneven:
        return []
    # One line for the model, however many layers: they are one mistake (the ep chosen), not one per layer.
    counts = sorted(set(module.num_experts for module in modules.values()))
    odd = sorted(set(uneven.values()))
    first = next(iter(uneven))
    where = first if len(uneven) == 1 else f"{len(uneven)} experts modules ({first}, ...)"
    held = (f"{odd[0]} experts" + (" each" if len(uneven) > 1 else "")) if len(odd) == 1 else \
        f"{', '.join(map(str, odd))} experts"
    common = functools.reduce(math.gcd, counts)
    fits = ", ".join(str(d) for d in range(1, common + 1) if common % d == 0)
    divides = f"{counts[0]}" if len(counts) == 1 else f"every layer's count ({', '.join(map(str, counts))})"
    return [f"parallel.ep: {where} hold{'s' * (len(uneven) == 1)} {held}, which do not split over ep={ep} ranks; "
            f"use an ep that divides {divides}: {fits}"]


def split(model: nn.Module, mesh) -> Dict[str, int]:
    """Each experts module's parameters sharded by expert over the 1-D `mesh` (the ep ranks) and its forward
    dispatching tokens to them; returns each module's expert count, by name. Every rank holds the same initial
    weights (one seed), so each keeps its own slice and nothing is sent."""
    from torch.distributed.tensor import Shard, distribute_tensor

    ep = mesh.size()
    modules = found(model)
    wrong = problems(model, ep)
    if wrong:
        raise UserError(*wrong)
    wrappers = adapters(model)
    for module in modules.values():
        for name, param in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.data, mesh, [Shard(0)], src_data_rank=None)
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        module.forward = _Dispatch(module, type(module).forward, mesh.get_group(), ep, mesh.get_local_rank(),
                                   wrappers.get(module, {}))
    return {name: module.num_experts for name, module in modules.items()}


def adapters(model: nn.Module) -> Dict[nn.Module, Dict[str, List[nn.Module]]]:
    """LoRA on the experts' own weights (peft's target_parameters), by experts module and parameter name: peft
    wraps the experts module in a ParamWrapper per adapted parameter (nested), whose forward adds the adapters'
    update to the whole [E, ...] weight for the call (a parametrization). Under ep each rank holds its slice
    alone, and FSDP gathers it only inside the experts module's own call, after the wrapper's forward: so the
    wrappers' forwards are made to pass through, and each rank's view of its experts (`_Local`) adds its experts'
    share of the update to its slice. The adapters stay whole on every rank (sharded with the dense parts, whose
    gradients FSDP averages over every data-parallel rank): each expert's rows of their gradient come from the one
    rank of the ep group that holds the expert, over the group's tokens, so their sum over the ranks is one
    process's, unscaled."""
    out: Dict[nn.Module, Dict[str, List[nn.Module]]] = {}
    for wrapper in model.modules():
        if not isinstance(getattr(wrapper, "parameter_name", None), str) or not hasattr(wrapper, "lora_A"):
            continue
        inner = wrapper.base_layer
        while hasattr(inner, "parameter_name") and hasattr(inner, "base_layer"):
            inner = inner.base_layer
        if is_experts(inner):
            out.setdefault(inner, {}).setdefault(wrapper.parameter_name, []).append(wrapper)
            wrapper.forward = functools.partial(_through, wrapper)
    return out


def _through(wrapper: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return wrapper.base_layer(*args, **kwargs)


def _adapted(weight: torch.Tensor, wrappers: List[nn.Module], first: int, count: int) -> torch.Tensor:
    """`weight`, this rank's experts' slice, plus the wrappers' active adapters' update of those experts (peft's
    ParamWrapper: scaling x lhs @ rhs per expert, in the weight's dtype, out of autocast, as peft adds it)."""
    experts = slice(first, first + count)
    for wrapper in wrappers:
        if wrapper.disable_adapters or wrapper.merged:
            continue
        for name in [a for a in wrapper.active_adapters if a in wrapper.lora_A]:
            with torch.autocast(device_type=weight.device.type, enabled=False):
                if hasattr(wrapper, "get_delta_factors"):  # peft >= 0.18: the factors, no whole-stack delta
                    lhs, rhs, scaling = wrapper.get_delta_factors(name)
                    weight = torch.baddbmm(weight, lhs[experts], rhs[experts], alpha=scaling)
                else:
                    weight = weight + wrapper.get_delta_weight(name)[experts].to(weight.dtype)
    return weight


class _Dispatch:
    """An experts module's forward under expert parallelism (the module's docstring, steps 1 to 4)."""

    def __init__(self, module: nn.Module, forward: Any, group: Any, ep: int, rank: int,
                 adapters: Dict[str, List[nn.Module]]):
        self.module, self.forward, self.group, self.ep, self.rank = module, forward, group, ep, rank
        self.adapters = adapters
        self.signature = inspect.signature(forward)

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        bound = self.signature.bind(self.module, *args, **kwargs)
        hidden, index, weights = list(bound.arguments.values())[1:4]
        view = _Local(self.module, self.module.num_experts // self.ep, self.ep, self.rank, self.adapters)
        return dispatched(view, self.forward, self.group, self.ep, hidden, index, weights)


def dispatched(view: "_Local", forward: Any, group: Any, ep: int, hidden: torch.Tensor, index: torch.Tensor,
               weights: torch.Tensor) -> torch.Tensor:
    """The experts' output for this rank's tokens [T, H], their experts [T, K] and weights [T, K], `view` this
    rank's experts: the module's docstring, steps 1 to 4. Collective over the ep group."""
    import torch.distributed as dist
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    tokens, k = index.shape
    local = view.num_experts
    experts = index.reshape(-1)
    order = torch.sort(experts, stable=True).indices  # pairs by expert, so by the rank that holds it
    send, receive = split_sizes(experts // local, ep, group)
    if routed_to is not None:
        routed_to(sum(send), sum(receive))
    rows = all_to_all_single_autograd(hidden[order // k], receive, send, group)
    which = torch.empty(sum(receive), dtype=experts.dtype, device=experts.device)
    dist.all_to_all_single(which, (experts[order] % local).contiguous(), receive, send, group=group)
    out = forward(view, rows, which[:, None], torch.ones(len(which), 1, dtype=weights.dtype, device=weights.device))
    if not len(which):
        # No token for this rank's experts: the forward's zeros depend on neither the rows nor the weights, so
        # the rows' all-to-all would get no backward here (the others' would wait for it) and the experts no
        # gradient; both joined in, adding zeros: their gradients are zeros, as one process's unused experts'.
        out = out + rows * 0 + sum(t.reshape(-1)[:1].sum() for t in view.tensors.values()) * 0
    back = all_to_all_single_autograd(out, send, receive, group)
    pairs = back[torch.argsort(order)]  # (token, slot) order again
    return (pairs.view(tokens, k, -1) * weights[..., None]).to(hidden.dtype).sum(dim=1)


def split_sizes(ranks: torch.Tensor, ep: int, group: Any) -> Tuple[List[int], List[int]]:
    """The (token, slot) pairs this rank sends to each rank of its ep group (`ranks`: each pair's), and those it
    receives from each: the next all-to-all's split sizes, exchanged and read on the host (a sync). The memory
    planner, whose tensors have no values, stands in for this alone (launcher/plan/standins.py)."""
    import torch.distributed as dist

    sending = torch.bincount(ranks, minlength=ep)
    receiving = torch.empty_like(sending)
    dist.all_to_all_single(receiving, sending, group=group)
    return sending.tolist(), receiving.tolist()


class _Local:
    """An experts module as its own forward sees it on this rank: each expert-indexed parameter its local slice
    (a plain tensor, whose gradient reaches the DTensor's, over ep) with its LoRA update if peft adapts it
    (`adapters`), `num_experts` the rank's count; anything else the module's own (its activation, its gate
    function, its config)."""

    def __init__(self, module: nn.Module, count: int, ep: int, rank: int, adapters: Dict[str, List[nn.Module]]):
        self.tensors = {name: _adapted(_Mean.apply(_local(p), ep), adapters.get(name, []), rank * count, count)
                        for name, p in module.named_parameters(recurse=False)}
        self.__dict__.update(self.tensors)
        self.num_experts = count
        self._module = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if hasattr(param, "to_local") else param


class _Mean(torch.autograd.Function):
    """The identity, its gradient divided by `ep`: a sum over the ep group's losses made their mean."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, ep: int) -> torch.Tensor:
        ctx.ep = ep
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad / ctx.ep, None
