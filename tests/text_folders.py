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


# Qwen2.5's template, as its tokenizer_config.json holds it (abridged to what tool calling renders): the tools'
# JSON schemas in the system turn, an assistant's tool_calls as <tool_call> blocks, tool results in a user turn.
QWEN25 = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n    {%- else %}\n        {{- 'You are a helpful assistant.' }}\n"
    "    {%- endif %}\n    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query."
    "\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n        {{- \"\\n\" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n"
    "{%- else %}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n            {{- '\\n' + message.content }}\n        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n        {%- endfor %}\n        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n")

# ChatML as templates that read a content given as a list of parts write it (Qwen2-VL's, Llama 3.2 Vision's): a
# string as it is, a list part by part, its text parts' text.
PARTS = CHATML.replace("{{ message['content'] }}",
                       "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
                       "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
                       "{% endif %}{% endfor %}{% endif %}")
