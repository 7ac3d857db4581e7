"""A small GPT-style language model in the manner of nanoGPT, and the loss that goes with it.

Pre-LayerNorm transformer blocks, causal self-attention through
`F.scaled_dot_product_attention(is_causal=True)` (a fused kernel where there is one),
a GELU MLP, learned position embeddings, and the output head sharing its weight with
the token embedding. Initialisation follows nanoGPT: every weight N(0, 0.02), biases
zero, and the projections that write into the residual stream N(0, 0.02 / sqrt(2 * n_layer)).

`forward(idx)` returns logits only; the loss is a separate module so that the launcher's
step (`loss(model(x), y)`, launcher.model.step.Supervised) and its metrics see the logits. No dropout by default:
dropout draws random numbers, which would make runs under different strategies differ.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd ({n_embd}) must be a multiple of n_head ({n_head})")
        self.n_head, self.head_size = n_head, n_embd // n_head
        self.dropout = dropout
        # query, key and value of every head at once, packed head by head (Megatron's layout): a split of
        # its rows into tensor-parallel shards gives each rank whole heads
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # (B, T, heads * 3 * head_size) -> 3 x (B, heads, T, head_size); heads: n_head, or this rank's share
        qkv = self.c_attn(x).view(B, T, -1, 3, self.head_size)
        q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).reshape(B, T, -1)  # heads side by side again
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float, bias: bool):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, dropout, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token ids (B, T) -> next-token logits (B, T, vocab_size), for T up to `block_size`."""

    def __init__(self, vocab_size: int, block_size: int, n_layer: int = 6, n_head: int = 6, n_embd: int = 384,
                 dropout: float = 0.0, bias: bool = False, tie_weights: bool = True):
        super().__init__()
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.n_layer, self.n_head, self.n_embd = n_layer, n_head, n_embd
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            drop=nn.Dropout(dropout),
            h=nn.ModuleList([Block(n_embd, n_head, dropout, bias) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd, bias=bias),
        ))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        if tie_weights:  # one matrix, two uses (off: the head its own, as pipeline stages need it)
            self.transformer.wte.weight = self.lm_head.weight

        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # residual projections, scaled for the depth (GPT-2)
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        if T > self.block_size:
            raise ValueError(f"a sequence of {T} tokens is longer than block_size {self.block_size}")
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameters, each counted once (the tied matrix once). Without the position embedding by default:
        it is a lookup, not a matmul; the token embedding stays in, as it is also the output head."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wpe.weight.numel()
        return n

    def flops_per_token(self) -> int:
        """Training FLOPs (forward and backward) per token at the full block_size: 6N for the matmuls
        with the weights, plus 12 * L * H * Q * T for attention (PaLM appendix B, nanoGPT's estimate_mfu)."""
        L, H, Q, T = self.n_layer, self.n_head, self.n_embd // self.n_head, self.block_size
        return 6 * self.num_params() + 12 * L * H * Q * T


class SequenceCrossEntropy(nn.Module):
    """Mean cross-entropy over every token: logits (B, T, V), integer targets (B, T). Computed in fp32."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
