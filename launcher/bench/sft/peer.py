"""The peer for the SFT row (launcher/bench/sft/row.py): TRL's `SFTTrainer` packing the same samples the launcher
trains on, from the same HF folder. The samples are the launcher's TextDataset's (the folder's tokenizer and
template, labels -100 but on the answers), handed to TRL as a tokenized dataset with its `labels`, so that both
sides train on the same tokens and targets; TRL packs them itself (`packing=True`, its best-fit decreasing
strategy "bfd", which makes its collator padding-free: a batch's rows in one sequence, boundaries from
position_ids). The model is loaded from the folder; AdamW (Trainer's adamw_torch_fused) at the recipe's learning
rate and weight decay, a constant schedule, no clipping; the rest at SFTConfig's defaults (its
gradient_checkpointing=True; bf16 on a GPU, fp32 on the CPU, as the launcher's side). Every step's end is timed
on the other sides' clock; the report adds the last logged loss, and TRL's rows and their tokens.

    python -m launcher.bench.sft.peer FOLDER DATA STEPS BATCH MAX_LEN SEED LOG_EVERY
"""

import sys
import tempfile

import torch

from launcher.bench.workload import StepClock, finish, trainer_callback

SKIP = 3  # the benchmark's code for a peer whose library is not installed
LR, WEIGHT_DECAY = 1.0e-3, 0.0  # recipes/hf_sft.yaml's optimizer


def main(argv: list) -> int:
    folder, data, steps, batch, max_len, seed, log_every = argv[0], argv[1], *map(int, argv[2:7])
    try:
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from trl import SFTConfig, SFTTrainer
    except ImportError:
        return SKIP
    from launcher.data.text import TextDataset

    samples = TextDataset(folder, data, max_len=max_len).samples
    dataset = Dataset.from_dict({"input_ids": [s["input_ids"] for s in samples], "labels": [s["labels"] for s in samples]})
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    clock, logged = StepClock(), {}

    cuda = torch.cuda.is_available()
    with tempfile.TemporaryDirectory(prefix="launcher-bench-trl-") as out:
        settings = SFTConfig(
            output_dir=out, max_steps=steps, per_device_train_batch_size=batch, learning_rate=LR,
            weight_decay=WEIGHT_DECAY, lr_scheduler_type="constant", max_grad_norm=0.0, logging_steps=log_every,
            save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True, bf16=cuda, use_cpu=not cuda,
            max_length=max_len, packing=True, packing_strategy="bfd", seed=seed)
        trainer = SFTTrainer(model=model, args=settings, train_dataset=dataset,
                             processing_class=AutoTokenizer.from_pretrained(folder), callbacks=[trainer_callback(clock, logged)])
        rows = trainer.train_dataset
        result = trainer.train()
    clock.report(loss=float(logged.get("loss", result.training_loss)), rows=len(rows),
                 tokens=sum(len(ids) for ids in rows["input_ids"]), optim=str(settings.optim).split(".")[-1].lower())
    return 0


if __name__ == "__main__":
    finish(main(sys.argv[1:]))
