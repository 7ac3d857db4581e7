"""Small HuggingFace models built from their configs in Python, and an image dataset for ViT: the models
the tolerance claims of docs/launching.md are measured and tested on (tests/test_hf_tolerance.py). Built here,
not in YAML, so that these tests do not depend on which config keys a recipe may name."""

from __future__ import annotations

import functools

import torch
import transformers
from torch.utils.data import Dataset

NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def bert(vocab_size: int = 256) -> torch.nn.Module:
    config = transformers.BertConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=128, **NO_DROPOUT)
    return transformers.BertForMaskedLM(config)


def t5(vocab_size: int = 256, feed_forward_proj: str = "relu") -> torch.nn.Module:
    config = transformers.T5Config(vocab_size=vocab_size, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                   dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
                                   feed_forward_proj=feed_forward_proj)
    return transformers.T5ForConditionalGeneration(config)


def gpt2(vocab_size: int = 256) -> torch.nn.Module:
    config = transformers.GPT2Config(vocab_size=vocab_size, n_positions=128, n_embd=32, n_layer=2, n_head=4,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def llama(vocab_size: int = 256, tie_word_embeddings: bool = True, num_key_value_heads: int = 2,
          attn_implementation: str = "sdpa") -> torch.nn.Module:
    config = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=num_key_value_heads,
                                      max_position_embeddings=128, tie_word_embeddings=tie_word_embeddings,
                                      attn_implementation=attn_implementation)
    return transformers.LlamaForCausalLM(config)


def qwen2(vocab_size: int = 256) -> torch.nn.Module:
    config = transformers.Qwen2Config(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      tie_word_embeddings=False)
    return transformers.Qwen2ForCausalLM(config)


def qwen3(vocab_size: int = 256) -> torch.nn.Module:
    """Qwen3: a norm over each attention head's features after its q and k projections (q_norm, k_norm)."""
    config = transformers.Qwen3Config(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=128, tie_word_embeddings=False)
    return transformers.Qwen3ForCausalLM(config)


def mistral(vocab_size: int = 256, sliding_window: int = 8) -> torch.nn.Module:
    """Mistral: attention within a sliding window of the last `sliding_window` positions."""
    config = transformers.MistralConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=128, sliding_window=sliding_window,
                                        tie_word_embeddings=False)
    return transformers.MistralForCausalLM(config)


def vit(classes: int = 4) -> torch.nn.Module:
    config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                    image_size=16, patch_size=4, num_channels=3, num_labels=classes, **NO_DROPOUT)
    return transformers.ViTForImageClassification(config)


def text() -> Dataset:
    """Byte passages of 16 to 64 tokens, the first 4 labels unscored (recipes/components/passages.py)."""
    from recipes.components.passages import Passages

    return Passages(n=512, min_len=16, max_len=64, prompt=4)


class Images(Dataset):
    """`n` 3x16x16 images whose class is the brightest quadrant, with noise: a task ViT can learn."""

    def __init__(self, n: int = 512, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, 4, (n,), generator=g)
        self.pixels = torch.randn(n, 3, 16, 16, generator=g) * 0.5
        for i, label in enumerate(self.labels.tolist()):
            r, c = divmod(label, 2)
            self.pixels[i, :, r * 8:(r + 1) * 8, c * 8:(c + 1) * 8] += 1.0

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        return {"pixel_values": self.pixels[i], "labels": self.labels[i]}


def passthrough(fn):
    """A decorator whose wrapper takes anything: the signature shows `fn`'s, the call decides."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    return wrapper


@passthrough
def blobs(n: int = 256, classes: int = 4):
    """A dataset behind a decorator that takes anything (what a refused keyword looks like at the call)."""
    from recipes.components.synthetic import Blobs

    return Blobs(n=n, dim=32, classes=classes)
