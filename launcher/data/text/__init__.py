"""Text data for causal language models: files and a model folder's tokenizer in, token samples out, with
the loss on the answers. Each piece is one file, swappable on its own:

    sources.py    rows of local files (JSONL, JSON, CSV, Parquet, plain text, a save_to_disk dataset), streamed
    tokenizer.py  the model folder's tokenizer, its files checked as untrusted input, nothing in it run
    formats.py    text (continued pretraining) and prompt_completion; labels from token offsets
    chat.py       chat: conversations rendered by a chat template, the assistant turns as answers
    conversation.py  a chat row's messages and tools, read as apply_chat_template reads them (tool calls, parts)
    pairs.py      preference: prompt, chosen, rejected (strings or conversations, as TRL reads them) -> two samples
    sandbox.py    the chat template compiled and rendered in transformers' sandbox, metered (filters.py: its filters)
    bounds.py     what a rendering may spend (characters a value, all it makes, steps, time), and the checks
    samples.py    rows into samples one at a time (max_len applied, text cut into rows), each with its place;
                  in several spawned processes for large files (TextDataset's num_proc)
    dataset.py    TextDataset: the pieces joined into a map-style dataset, for data.train / data.val
    streamed.py   TextStream: the same samples in the same order as a stream, read and tokenized as they come
    packing.py    several samples in one row, none seeing another (the step masks by document_ids)
    preference.py pairs as items (unpacked, or rows of whole pairs), max_len per sequence, the reference's values
    cache.py      the tokenized samples kept on disk (safetensors), keyed by the files' bytes, the tokenizer's
                  files, the chat template and the settings: a second run and every rank read them back
    mixing.py     several sources by weight: the recipe's sources checked, each one's count of an epoch, the
                  order its rows are drawn in (seed, source, pass), streams' interleaving (seed, epoch, block)
    mixture.py    Mixture: TextDatasets mixed by weight, each epoch's items drawn from (seed, epoch, index)
    mixed_stream.py  MixtureStream: TextStreams interleaved by weight, each source's place in the stream state"""

from launcher.data.text.dataset import TextDataset
from launcher.data.text.mixed_stream import MixtureStream
from launcher.data.text.mixture import Mixture
from launcher.data.text.streamed import TextStream

__all__ = ["Mixture", "MixtureStream", "TextDataset", "TextStream"]
