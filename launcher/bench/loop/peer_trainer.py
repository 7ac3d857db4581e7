"""The peer for the HF row: HF `Trainer` at its defaults on recipes/hf_causal_lm.yaml. The same
GPT2LMHeadModel from the same GPT2Config, the same Passages and Pad collate, the same batch, learning
rate and weight decay, all read from the recipe (launcher/bench/loop/raw_hf.py's `arguments`); the rest is
Trainer's own default (its optimizer, adamw_torch_fused on torch >= 2.8; its sampler), but for what the
launcher's recipe does not do: a constant learning rate, no gradient clipping, no evaluation,
checkpoint, tracker or progress bar, the loss read every 100 steps. One thread; every step's end is
timed by a callback on the same clock as the other sides (launcher/bench/workload.py).

    python -m launcher.bench.loop.peer_trainer [STEPS]
"""

import sys
import tempfile

import torch
import yaml

from launcher.bench.loop.raw_hf import RECIPE, arguments
from launcher.bench.workload import StepClock, finish, trainer_callback
from launcher.data.collate import Pad
from recipes.components.passages import Passages

SKIP = 3  # the benchmark's code for a peer whose library is not installed


def main(argv: list) -> int:
    steps = int(argv[0]) if argv else 200
    try:
        from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    except ImportError:
        return SKIP
    torch.set_num_threads(1)
    recipe = yaml.safe_load(RECIPE.read_text())
    optimizer = arguments(recipe, "optimizer")
    torch.manual_seed(recipe["seed"])
    others = {k: v for k, v in arguments(recipe, "model").items() if k != "config"}
    model = GPT2LMHeadModel(GPT2Config(**arguments(recipe, "model.config")), **others)
    clock, logged = StepClock(), {}

    with tempfile.TemporaryDirectory(prefix="launcher-bench-trainer-") as out:
        settings = TrainingArguments(
            output_dir=out, max_steps=steps, per_device_train_batch_size=recipe["data"]["batch_size"],
            learning_rate=optimizer["lr"], weight_decay=optimizer.get("weight_decay", 0.0),
            lr_scheduler_type="constant", max_grad_norm=0.0, logging_steps=100, save_strategy="no",
            eval_strategy="no", report_to="none", disable_tqdm=True, use_cpu=not torch.cuda.is_available(),
            dataloader_num_workers=recipe["data"].get("num_workers", 0), seed=recipe["seed"])
        trainer = Trainer(model=model, args=settings, train_dataset=Passages(**arguments(recipe, "data.train")),
                          data_collator=Pad(**arguments(recipe, "data.collate")), callbacks=[trainer_callback(clock, logged)])
        result = trainer.train()
    # Its last logged loss, the mean over the steps since the log before (with fewer than 100 steps, none
    # was logged: the mean over all of them, as the launcher's last log step has it)
    clock.report(loss=float(logged.get("loss", result.training_loss)), optim=str(settings.optim).split(".")[-1].lower())
    return 0


if __name__ == "__main__":
    finish(main(sys.argv[1:]))
