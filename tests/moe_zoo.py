"""Tiny mixture-of-experts models of the four families transformers 5 publishes them in, built from their configs
(hidden 32, 2 layers, 4 or 8 experts, top 2): the models tests/test_moe.py trains, loads and exports.

`FAMILIES[name]` is (the model's class, its config's class, the config's keys): what a recipe names as
`model: {_target_: transformers.<model>, config: {_target_: transformers.<config>, ...}}`. `folder` writes one
as save_pretrained does, in the published layout (each expert's own matrices). `forced` is a gpt-oss model whose
routers send every token to experts 0 and 1."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Tuple

import torch
import transformers

SMALL = dict(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, max_position_embeddings=128, tie_word_embeddings=False)
ROPE = {"rope_type": "default", "rope_theta": 10000.0}  # gpt-oss and DeepSeek-V3 default to YaRN for long contexts

FAMILIES: Dict[str, Tuple[str, str, Dict[str, Any]]] = {
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                  dict(SMALL, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=64)),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig",
                dict(SMALL, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)),
    "gpt_oss": ("GptOssForCausalLM", "GptOssConfig",
                dict(SMALL, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, rope_parameters=ROPE)),
    # shared experts and grouped routing (the best 1 of 2 groups of 4 experts), a dense first layer; multi-head
    # latent attention, whose key and value heads are the query's (head_dim: its rotary part)
    "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config",
                    dict(SMALL, num_key_value_heads=4, head_dim=4, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                         topk_group=1, n_shared_experts=1, moe_intermediate_size=16, intermediate_size=64,
                         first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4,
                         qk_nope_head_dim=4, v_head_dim=8, rope_parameters=ROPE)),
}
MOE_LAYERS = {"qwen3_moe": [0, 1], "mixtral": [0, 1], "gpt_oss": [0, 1], "deepseek_v3": [1]}
EXPERTS = {"qwen3_moe": 8, "mixtral": 4, "gpt_oss": 4, "deepseek_v3": 8}


def config(name: str, **keys: Any):
    _, config_class, defaults = FAMILIES[name]
    return getattr(transformers, config_class)(**{**defaults, **keys})


def model(name: str, **keys: Any) -> torch.nn.Module:
    return getattr(transformers, FAMILIES[name][0])(config(name, **keys))


def model_section(name: str, **keys: Any) -> dict:
    """A recipe's model section that builds the family's model from its config."""
    model_class, config_class, defaults = FAMILIES[name]
    return {"_target_": f"transformers.{model_class}",
            "config": {"_target_": f"transformers.{config_class}", **defaults, **keys}}


def folder(path: Path, name: str, seed: int = 0, **keys: Any) -> Path:
    """A random model of the family written by save_pretrained (the published layout), in shards with their index."""
    torch.manual_seed(seed)
    transformers.utils.logging.disable_progress_bar()
    model(name, **keys).save_pretrained(path, max_shard_size="60KB")
    return path


def forced(**keys: Any) -> torch.nn.Module:
    """A gpt-oss model whose routers' biases send every token to experts 0 and 1 (its top 2)."""
    built = model("gpt_oss", **keys)
    with torch.no_grad():
        for layer in built.model.layers:
            layer.mlp.router.bias[:2] = 50.0
    return built
