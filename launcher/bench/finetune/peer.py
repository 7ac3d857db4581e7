"""The peer for the fine-tuning row of python -m launcher.bench.gpu --finetune: HF `Trainer` fine-tuning the
same HF folder (from_pretrained, fp32 master weights, bf16 autocast: `bf16=True`), on the same Passages of
one length with the same Pad collate, batch and learning rate; activation checkpointing
(`gradient_checkpointing`) and torch.compile (`torch_compile`) as the launcher's side has them; the rest
at Trainer's defaults (adamw_torch_fused), a constant learning rate, no clipping, no evaluation,
checkpoint or tracker. Every step's end is timed by a callback on the launcher side's clock.

    python -m launcher.bench.finetune.peer FOLDER STEPS BATCH LENGTH CHECKPOINTING(0|1) COMPILE(0|1)
"""

import sys
import tempfile

import torch

from launcher.bench.workload import StepClock, finish, trainer_callback
from launcher.data.collate import Pad
from recipes.components.passages import Passages

SKIP = 3  # the benchmark's code for a peer whose library is not installed


def main(argv: list) -> int:
    folder, steps, batch, length, checkpointing, compile = argv[0], *map(int, argv[1:6])
    try:
        from transformers import AutoModelForCausalLM, Trainer, TrainingArguments
    except ImportError:
        return SKIP
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    clock = StepClock()

    with tempfile.TemporaryDirectory(prefix="launcher-bench-trainer-") as out:
        settings = TrainingArguments(
            output_dir=out, max_steps=steps, per_device_train_batch_size=batch, learning_rate=1e-4, weight_decay=0.0,
            lr_scheduler_type="constant", max_grad_norm=0.0, logging_steps=50, save_strategy="no", eval_strategy="no",
            report_to="none", disable_tqdm=True, bf16=torch.cuda.is_available(), use_cpu=not torch.cuda.is_available(),
            gradient_checkpointing=bool(checkpointing), torch_compile=bool(compile), seed=0)
        data = Passages(n=max(2048, steps * batch), min_len=length, max_len=length, prompt=8)
        trainer = Trainer(model=model, args=settings, train_dataset=data, data_collator=Pad(values={"labels": -100}),
                          callbacks=[trainer_callback(clock)])
        trainer.train()
    clock.report(optim=str(settings.optim).split(".")[-1].lower())
    return 0


if __name__ == "__main__":
    finish(main(sys.argv[1:]))
