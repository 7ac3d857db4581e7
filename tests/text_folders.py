"""Tokenizer folders for the text-data tests, written here as save_pretrained writes them (nothing downloaded):
the tiny Llama folder's BPE with its ChatML template, and GPT-2's byte-level layout with a Llama-3-like one;
each template also with `{% generation %}` markers, rendering the same text."""

from pathlib import Path

from recipes.components.tiny_tokenizer import CHATML, LLAMA3, bpe, byte_level

# The same templates with each assistant turn (its content and end-of-turn token) in a generation block. The
# newline after a turn is written as an expression: Jinja drops the newline after a block tag (trim_blocks).
MARKED = {
    "bpe": CHATML.replace("{{ message['content'] }}<|im_end|>\n",
                          "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}<|im_end|>"
                          "{% endgeneration %}{% else %}{{ message['content'] }}<|im_end|>{% endif %}{{ '\\n' }}"),
    "byte_level": LLAMA3.replace("{{ message['content'] | trim }}<|eot_id|>",
                                 "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim }}"
                                 "<|eot_id|>{% endgeneration %}{% else %}{{ message['content'] | trim }}<|eot_id|>"
                                 "{% endif %}"),
}
END_OF_TURN = {"bpe": "<|im_end|>", "byte_level": "<|eot_id|>"}
LAYOUTS = ("bpe", "byte_level")


def tokenizer_folder(where: Path, layout: str = "bpe", marked: bool = False, template=None) -> Path:
    """A folder holding only a tokenizer of `layout`, with its template (marked: with generation blocks)."""
    build = {"bpe": bpe, "byte_level": byte_level}[layout]
    chosen = template if template is not None else MARKED[layout] if marked else None
    tokenizer = build() if chosen is None else build(template=chosen)
    folder = where / f"{layout}{'-marked' if marked else ''}"
    tokenizer.save_pretrained(folder)
    return folder
