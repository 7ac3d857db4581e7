"""The peer for the DPO row (launcher/bench/dpo/row.py): TRL's `DPOTrainer` (trl 1.16) on the same HF folder and the
same pairs as recipes/hf_dpo.yaml, with the reference's log-probabilities computed once before training
(`precompute_ref_log_probs`, TRL's own pass over every pair with the model as it starts), the sigmoid loss at the
same beta, SGD at the same learning rate (no momentum, no weight decay, a constant schedule, no clipping), fp32 on
the CPU, dropout off (TRL's `disable_dropout`), the pairs in file order (`train_sampling_strategy="sequential"`,
the launcher's `data.shuffle=false`), its recomputation at its default (DPOConfig's `gradient_checkpointing=True`).
Every step's end is timed on the other sides' clock (launcher/bench/workload.py); a log every step gives the loss
of each step (Trainer's `loss` over an interval of one step: that step's forward, before its update).

How TRL 1.16 makes a pair of plain strings into tokens (`DPOTrainer._prepare_dataset`, read from its code):

- EOS is appended to `chosen` and `rejected` as text (`chosen + tokenizer.eos_token`, unless it ends so already);
  the tokenizer then reads that text back as the EOS token.
- `tokenizer(text=prompt)`, `tokenizer(text=prompt + chosen + eos)` and `tokenizer(text=prompt + rejected + eos)`,
  each with the tokenizer's special tokens (the tiny BPE's BOS `<s>` in front; the strings are joined with
  nothing between them: a space, if any, is the answer's). The prompt is the longest common prefix of the
  prompt's tokens and the two joined texts' tokens; the rest of each is its answer, the loss taken on it (EOS
  included), never on the prompt (a boundary whose tokens merge moves the answer's start to where they differ).
- `max_length` (1024 by default; the row sets its max_len) cuts prompt + answer at the end (`keep_start`), each
  sequence on its own; a pair whose prompt alone fills it is dropped. Batches pad on the right with PAD (the
  tiny BPE has none: EOS), chosen rows first then rejected; the log-probability of an answer is the sum over
  its tokens.

A conversational pair (lists of messages) is rendered by the chat template: the prompt with the generation prompt,
prompt + chosen and prompt + rejected whole, each tokenized without special tokens; the answer is what follows the
prompt's tokens to the end, its end of turn and what the template writes after it (ChatML's newline) included,
which the launcher's preference data scores too (launcher/data/text/pairs.py).

For strings, the row writes pairs on which tokenizing the whole text and tokenizing its parts agree: a prompt ending
in a character no answer's first token joins ("?"), answers beginning with a space and a word, no EOS in the text,
and a max_len above every pair: the launcher's preference data (prompt then answer, as prompt_completion: BOS, the
text tokenized whole, labels on the answer's characters, EOS after it) sees the same tokens.

    python -m launcher.bench.dpo.peer FOLDER PAIRS STEPS BATCH MAX_LEN BETA LR
"""

from __future__ import annotations

import json
import sys
import tempfile
from typing import Any, Dict, List

import torch

from launcher.bench.workload import StepClock, finish, trainer_callback

SKIP = 3  # the benchmark's code for a peer whose library is not installed


def pairs(path: str) -> List[Dict[str, str]]:
    """The JSON Lines file's pairs, in order: {prompt, chosen, rejected} a line."""
    with open(path) as f:
        return [{k: row[k] for k in ("prompt", "chosen", "rejected")} for row in map(json.loads, f) if row]


def trainer(folder: str, data: str, steps: int, batch: int, max_len: int, beta: float, lr: float, out: str,
            callbacks: tuple = ()) -> Any:
    """TRL's DPOTrainer as the row runs it (the reference pass is made here, when it is built)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    settings = DPOConfig(
        output_dir=out, max_steps=steps, per_device_train_batch_size=batch, learning_rate=lr, optim="sgd",
        weight_decay=0.0, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=0.0, beta=beta,
        loss_type=["sigmoid"], max_length=max_len, precompute_ref_log_probs=True, disable_dropout=True,
        train_sampling_strategy="sequential", logging_steps=1, save_strategy="no", eval_strategy="no",
        report_to="none", disable_tqdm=True, bf16=False, use_cpu=True, seed=0)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    # an in-memory dataset: its reference pass is cached in a temporary folder of this process, not across runs
    return DPOTrainer(model=model, args=settings, train_dataset=Dataset.from_list(pairs(data)),
                      processing_class=AutoTokenizer.from_pretrained(folder), callbacks=list(callbacks))


def tokenized(folder: str, data: str, max_len: int) -> Any:
    """TRL's tokens of the pairs (prompt_ids, chosen_ids, rejected_ids a pair), by TRL's own code: the dataset
    preparation DPOTrainer runs when it is built (a private method, called here without building a trainer, whose
    reference pass would run too), read from trl 1.16."""
    import types
    import warnings

    from datasets import Dataset
    from datasets.utils.logging import disable_progress_bar
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    disable_progress_bar()  # called in the benchmark's own process: its output is the row
    tokenizer = AutoTokenizer.from_pretrained(folder)
    with tempfile.TemporaryDirectory(prefix="launcher-bench-trl-") as out, warnings.catch_warnings():
        # DPOConfig's own default (gradient_checkpointing=True) warns of its rename in transformers 6
        warnings.simplefilter("ignore", FutureWarning)
        settings = DPOConfig(output_dir=out, max_length=max_len, bf16=False, use_cpu=True, report_to="none")
        return DPOTrainer._prepare_dataset(types.SimpleNamespace(_tokenizer=tokenizer),
                                           Dataset.from_list(pairs(data)), tokenizer, settings, "train")


def losses_callback(losses: Dict[int, float]) -> Any:
    """A Trainer callback: each logged loss into `losses[step]`."""
    from transformers import TrainerCallback

    class Losses(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses[state.global_step] = float(logs["loss"])

    return Losses()


def main(argv: list) -> int:
    folder, data, steps, batch, max_len, beta, lr = argv[0], argv[1], *map(int, argv[2:5]), *map(float, argv[5:7])
    try:
        import trl  # noqa: F401
    except ImportError:
        return SKIP
    clock, losses = StepClock(), {}
    with tempfile.TemporaryDirectory(prefix="launcher-bench-trl-") as out:
        run = trainer(folder, data, steps, batch, max_len, beta, lr, out,
                      (trainer_callback(clock), losses_callback(losses)))
        rows = run.train_dataset
        run.train()
    tokens = sum(2 * len(p) + len(c) + len(r) for p, c, r in zip(rows["prompt_ids"], rows["chosen_ids"],
                                                                  rows["rejected_ids"]))
    clock.report(losses={str(k): v for k, v in sorted(losses.items())}, pairs=len(rows), tokens=tokens)
    return 0


if __name__ == "__main__":
    finish(main(sys.argv[1:]))
