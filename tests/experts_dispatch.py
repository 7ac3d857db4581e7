"""Under torchrun, two processes on gloo: the experts module of four HF mixtures of experts (Qwen3-MoE, Mixtral,
gpt-oss with its biases and transposed weights, DeepSeek-V3), split over ep 2 by launcher.parallel.experts and
called on each rank's own tokens, against the whole module called in one process on both ranks' tokens: the
outputs, the tokens' gradients and the experts' gradients (each rank's slice: the sum over both ranks' losses,
over ep). In float64 through the eager loop, and Qwen3-MoE's in float32 through transformers' grouped kernel.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/experts_dispatch.py OUT.json

Each case once with tokens routed anywhere, once with every token routed to the first rank's experts (the second
rank's get none: their gradients must still be there, zeros). Rank R writes OUT.rank<R>.json: for each case, the
largest difference of each quantity relative to the reference's largest value, and whether each slice has a
gradient."""

import copy
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

sys.path.insert(0, os.getcwd())  # run as a script from the repository's root

SMALL = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)


def experts_of(name: str) -> torch.nn.Module:
    """The experts module of a tiny model `name` (8 experts, top 2)."""
    if name.startswith("qwen3_moe"):
        config = transformers.Qwen3MoeConfig(**SMALL, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2)
        model = transformers.Qwen3MoeForCausalLM(config)
    elif name == "mixtral":
        config = transformers.MixtralConfig(**SMALL, intermediate_size=16, num_local_experts=8, num_experts_per_tok=2)
        model = transformers.MixtralForCausalLM(config)
    elif name == "gpt_oss":
        config = transformers.GptOssConfig(**SMALL, intermediate_size=16, num_local_experts=8, num_experts_per_tok=2,
                                           head_dim=8, layer_types=["full_attention"])
        model = transformers.GptOssForCausalLM(config)
    else:
        config = transformers.DeepseekV3Config(**SMALL, moe_intermediate_size=16, n_routed_experts=8,
                                               num_experts_per_tok=2, first_k_dense_replace=0, n_group=2,
                                               topk_group=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                                               qk_nope_head_dim=8, v_head_dim=8)
        model = transformers.DeepseekV3ForCausalLM(config)
    experts = model.model.layers[0].mlp.experts
    experts.config._experts_implementation = "grouped_mm" if name.endswith("grouped") else "eager"
    return experts


def case(name: str, skewed: bool, rank: int, mesh) -> dict:
    from launcher.parallel import experts

    dtype = torch.float32 if name.endswith("grouped") else torch.float64
    torch.manual_seed(0)  # the same module and tokens on both ranks
    module = experts_of(name).to(dtype)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape) * 0.3)
    whole = copy.deepcopy(module)
    count, tokens, hidden = module.num_experts, 6, 32
    states = torch.randn(2, tokens, hidden, dtype=dtype)
    choices = count // 2 if skewed else count  # skewed: the first rank's experts alone
    index = torch.stack([torch.randperm(choices)[:2] for _ in range(2 * tokens)]).view(2, tokens, 2)
    weights = torch.rand(2, tokens, 2, dtype=dtype)
    scale = torch.tensor([1.0, 2.0], dtype=dtype)  # each rank's loss weighed apart: a mix-up shows

    experts.split(module, mesh)
    mine = states[rank].clone().requires_grad_()
    out = module(mine, index[rank], weights[rank])
    (out * scale[rank]).sum().backward()

    every = states.clone().requires_grad_()
    reference = whole(every.view(-1, hidden), index.view(-1, 2), weights.view(-1, 2)).view(2, tokens, hidden)
    (reference * scale[:, None, None]).sum().backward()

    def apart(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()

    local = slice(rank * count // 2, (rank + 1) * count // 2)
    grads = {name: p.grad for name, p in module.named_parameters()}
    return {"output": apart(out, reference[rank]), "tokens": apart(mine.grad, every.grad[rank]),
            "experts": {n: apart(g.to_local(), whole.get_parameter(n).grad[local] / 2) if g is not None else None
                        for n, g in grads.items()},
            "zeros": {n: bool(g is not None and not g.to_local().any()) for n, g in grads.items()}}


def main(out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    results = {f"{name}{'-skewed' if skewed else ''}": case(name, skewed, rank, mesh)
               for name in ("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3", "qwen3_moe-grouped")
               for skewed in (False, True)}
    Path(out).with_suffix(f".rank{rank}.json").write_text(json.dumps(results, indent=1))
    dist.barrier()  # neither rank's group goes while the other still reads from it
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
