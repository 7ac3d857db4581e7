"""Small tokenizers trained here in a moment with the `tokenizers` library, saved into a model folder as a real
one's is (transformers' save_pretrained: tokenizer.json, tokenizer_config.json, chat_template.jinja): the
tokenizer of `hf_folder.py`'s random Llama, and a second layout for the tests. Nothing is downloaded.

- `bpe`: a BPE over printable ASCII words (SentencePiece-like in what it adds: BOS `<s>` before a text, EOS
  `</s>`, no PAD), with a ChatML chat template (`<|im_start|>role ... <|im_end|>`).
- `byte_level`: GPT-2's layout (its ByteLevel pre-tokenizer and decoder: any text, in bytes; no BOS added),
  with a PAD token and a Llama-3-like template (`<|start_header_id|>role<|end_header_id|> ... <|eot_id|>`).
"""

from __future__ import annotations

import string
from typing import Any, List

# A few sentences of the kind the shipped chat data holds: what the merges are learnt from.
SENTENCES = [
    "What is 12 plus 7? 12 plus 7 is 19.", "What is 9 times 3? 9 times 3 is 27.",
    "You are a helpful assistant who answers in one sentence.", "Hello! How can I help you today?",
    "The capital of France is Paris. The quick brown fox jumps over the lazy dog.",
    "Please write the next number: 4, 5, 6. The next number is 7.", "Thank you, that is right.",
]
CHATML = ("{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
          "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
          "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


def bpe(vocab: int = 256, sentences: List[str] = SENTENCES, template: str = CHATML) -> Any:
    """A BPE of at most `vocab` tokens: `<s>` 0, `</s>` 1, `<unk>` 2, the chat tokens, printable ASCII, merges."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    # words with the space before them, digits one by one, punctuation, whitespace: every character kept, so
    # that the tokens' text is the text (the Fuse decoder joins them back)
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r" ?[A-Za-z]+| ?[0-9]| ?[^A-Za-z0-9\s]+|\s+"), "isolated")
    tokenizer.decoder = decoders.Fuse()
    alphabet = sorted(set(string.printable) - set("\x0b\x0c"))
    tokenizer.train_from_iterator(sentences, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=special, initial_alphabet=alphabet, limit_alphabet=len(alphabet),
        show_progress=False))
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                             special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   chat_template=template)


def byte_level(vocab: int = 384, sentences: List[str] = SENTENCES, template: str = LLAMA3) -> Any:
    """GPT-2's layout, of at most `vocab` tokens: the 256 bytes, merges, then `<|endoftext|>` (BOS and EOS),
    `<|pad|>` and the chat tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<|endoftext|>", "<|pad|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=True)
    tokenizer.train_from_iterator(sentences, trainers.BpeTrainer(
        vocab_size=vocab - len(special), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tokenizer.add_special_tokens(special)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   pad_token="<|pad|>", chat_template=template)
