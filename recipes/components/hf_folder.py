"""A small HF model folder to fine-tune from, written by `save_pretrained` (random weights, nothing
downloaded): what recipes/hf_finetune.yaml and recipes/hf_sft.yaml read where a real one (Llama, Qwen, ...)
would be. Its tokenizer is a small BPE with a ChatML chat template (tiny_tokenizer.py), trained here.

    python -m recipes.components.hf_folder runs/tiny-llama [--dtype bf16] [--shard-size 200KB] [--layers 2 --width 64]
    python -m recipes.components.hf_folder runs/tiny-qwen3-moe --moe    # a Qwen3-MoE: 8 experts a layer, top 2

Docs: docs/fine-tuning.md (in the source tree).
"""

from __future__ import annotations

import argparse
import sys


def write(folder: str, dtype: str = "fp32", shard_size: str = "5GB", layers: int = 2, width: int = 64,
          tie: bool = False, seed: int = 0, vocab: int = 256, heads: int = 4, kv_heads: int = 2,
          intermediate: int = 0, context: int = 256, tokenizer: bool = True, moe: bool = False) -> None:
    """A random Llama of this shape (the MLP 2 x width unless `intermediate` is given) saved in `folder`, with
    its tokenizer (`tiny_tokenizer.bpe`, of at most `vocab` tokens: BOS 0, EOS 1) unless `tokenizer` is false.
    With `moe`, a Qwen3-MoE instead: each layer's MLP 8 experts of width / 2, each token routed to 2 (saved as
    published, each expert's own matrices)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    shape = dict(vocab_size=vocab, hidden_size=width, num_hidden_layers=layers, num_attention_heads=heads,
                 num_key_value_heads=kv_heads, max_position_embeddings=context, tie_word_embeddings=tie,
                 bos_token_id=0, eos_token_id=1)
    if moe:
        built = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **shape, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=intermediate or width // 2))
    else:
        built = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape,
                                                                       intermediate_size=intermediate or 2 * width))
    transformers.utils.logging.disable_progress_bar()  # save_pretrained's bar for a folder of one or two files
    model = built.to({"fp32": torch.float32, "bf16": torch.bfloat16}[dtype])
    model.save_pretrained(folder, max_shard_size=shard_size)
    if tokenizer:
        from recipes.components.tiny_tokenizer import bpe

        tokens = bpe(vocab)
        if len(tokens) > vocab:  # the BPE holds printable ASCII and its special tokens at least
            raise ValueError(f"vocab {vocab} is smaller than the tokenizer's {len(tokens)} tokens; tokenizer=False")
        tokens.save_pretrained(folder)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipes.components.hf_folder", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--shard-size", default="5GB", help="save_pretrained's max_shard_size: smaller gives shards")
    parser.add_argument("--tie", action="store_true", help="tie the output layer to the input embedding")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers")
    parser.add_argument("--width", type=int, default=64, help="hidden size (the MLP's is twice that)")
    parser.add_argument("--moe", action="store_true", help="a Qwen3-MoE (8 experts a layer, top 2) instead of a Llama")
    args = parser.parse_args(argv)
    write(args.folder, args.dtype, args.shard_size, layers=args.layers, width=args.width, tie=args.tie, moe=args.moe)
    print(f"wrote {args.folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
