"""A tiny HF Qwen3-MoE, built from its config, for the expert-parallel tests (tests/test_experts.py): hidden 32, two
layers, 8 experts, top 2, its experts' eager loop (transformers' grouped kernels have no float64 kernel, and the
tests train in float64: tests/rounding.py; `implementation=grouped_mm` takes them, in float32).

Its routing is uneven by construction. Each router's rows are one direction u scaled by 4, 3, 2, 1, -1, -2, -3,
-4 (a little noise added to all but the middle two), so a token whose hidden state leans along u goes to experts 0
and 1, one leaning against it to experts 6 and 7, and the middle ones get none, or few once training turns them. Every token's
embedding holds 1 in its first dimension (the others are HF's initial ones, ~0.02), so every hidden state leans
along that dimension: the first layer's u is it, and every token goes to experts 0 and 1 (under ep x 2, experts
0-3 on one rank and 4-7 on the other, the second rank's experts get no token at all); the second layer's u is
random, across it, and the ranks receive different numbers of tokens.

`report=True` prints, at each call of an experts module, one line: `routed: <module> <tokens per expert>` (its
(token, slot) pairs by expert), which the tests read from each rank's output."""

from __future__ import annotations

import torch
import transformers

SCALES = (4.0, 3.0, 2.0, 1.0, -1.0, -2.0, -3.0, -4.0)


def qwen3_moe(experts: int = 8, report: bool = False, vocab_size: int = 256,
              implementation: str = "eager") -> torch.nn.Module:
    config = transformers.Qwen3MoeConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                                         moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
                                         num_experts=experts, num_experts_per_tok=2, norm_topk_prob=True,
                                         tie_word_embeddings=False, experts_implementation=implementation)
    model = transformers.Qwen3MoeForCausalLM(config)
    g = torch.Generator().manual_seed(1)
    scales = torch.tensor(SCALES[:experts // 2] + SCALES[-(experts // 2):])
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 1.0
        for i, layer in enumerate(model.model.layers):
            u = torch.zeros(32)
            if i == 0:
                u[0] = 1.0
            else:
                u[1:] = torch.randn(31, generator=g)
            noise = 0.05 * torch.randn(experts, 32, generator=g) * (scales.abs() > 1)[:, None]
            layer.mlp.gate.weight.copy_(0.5 * scales[:, None] * u + noise)
    if report:
        for name, module in model.named_modules():
            if name.endswith("mlp.experts"):
                module.register_forward_pre_hook(_reporter(name))
    return model


def _reporter(name: str):
    def report(module, args):
        index = args[1]
        counts = torch.bincount(index.reshape(-1), minlength=module.num_experts).tolist()
        print(f"routed: {name} {' '.join(map(str, counts))}", flush=True)

    return report


def text():
    """Byte passages of 8 to 24 tokens, the first 2 labels unscored: few tokens a step, so that the experts of the
    middle rows get none in some steps."""
    from recipes.components.passages import Passages

    return Passages(n=256, min_len=8, max_len=24, prompt=2)


def routed(said: str):
    """The lines `report=True` printed, as (module name, tokens per expert), in order."""
    out = []
    for line in said.splitlines():
        if line.startswith("routed: "):
            _, name, *counts = line.split()
            out.append((name, [int(c) for c in counts]))
    return out
