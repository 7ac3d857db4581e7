"""Benchmark peer: the reference workload trained through a Lightning Trainer, timed like raw.py.

    python -m launcher.bench.loop.peer_lightning STEPS
    python -m torch.distributed.run --standalone --nproc_per_node=2 -m launcher.bench.loop.peer_lightning STEPS

Lightning's usual setup: self.log each step, TensorBoardLogger under /tmp, log_every_n_steps=100. Under torchrun
it runs strategy="ddp" over torchrun's world (gloo on CPU). Exits 3 when lightning is not installed."""

import os
import sys
import tempfile

import torch
from torch import nn

from launcher.bench.workload import StepClock, finish, make_data, make_model

try:
    import lightning as L
    from lightning.pytorch.loggers import TensorBoardLogger
except ImportError:
    try:
        import pytorch_lightning as L
        from pytorch_lightning.loggers import TensorBoardLogger
    except ImportError:
        print("lightning is not installed", file=sys.stderr)
        sys.exit(3)

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
BATCH = 64


class Module(L.LightningModule):
    def __init__(self, clock: StepClock):
        super().__init__()
        self.clock = clock
        torch.manual_seed(0)
        self.model = make_model()
        self.loss_fn = nn.CrossEntropyLoss()

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.loss_fn(self.model(x), y)
        self.log("loss", loss)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.clock.tick()  # one optimizer step per batch

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def main() -> None:
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's world; Lightning adds the DistributedSampler
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    loader = torch.utils.data.DataLoader(make_data(), batch_size=BATCH // world, shuffle=True, drop_last=True)
    clock = StepClock()
    logs = tempfile.TemporaryDirectory(prefix="launcher-bench-lightning-")  # removed when the process ends
    trainer = L.Trainer(
        max_steps=STEPS, accelerator="auto" if torch.cuda.is_available() else "cpu",
        devices=local, num_nodes=world // local, strategy="ddp" if world > 1 else "auto",
        logger=TensorBoardLogger(logs.name),
        log_every_n_steps=100, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Module(clock), loader)
    if trainer.global_rank == 0:
        clock.report(loss=float(trainer.callback_metrics["loss"]))


if __name__ == "__main__":
    main()
    finish()
