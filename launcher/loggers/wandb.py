"""`logging.wandb`: one Weights & Biases run per run folder, continued across resumes and requeues.

wandb writes into <run_dir>/wandb/ (offline runs too: `wandb sync <run_dir>/wandb/offline-run-*` uploads
them). The run's id is chosen here and kept in <run_dir>/trackers.json, and every start passes it with
resume="allow". wandb's console capture is off: the launcher's own lines stay as they are.

What the run holds: wandb hands values to its own process, which writes them when it can; a run killed
with kill -9 may lose what that process had not written. So the record says which step the W&B run holds
only after a finish (which flushes everything), and an online run also asks W&B's server (starting_step);
a resume re-sends the steps after that, rather than lose them.
"""

from __future__ import annotations

import secrets
import string
from typing import Dict, Optional

from launcher.errors import UserError, first_line
from launcher.loggers import Start

PACKAGE = ("wandb", "wandb")


def backend(section, run_dir):
    return WandB(section)


class WandB:
    key = "wandb"
    continues = True

    def __init__(self, cfg):
        self.cfg = cfg
        self.run = None
        self.kept: Dict[str, object] = {}
        self.held = self.last = 0  # the last step the W&B run holds for sure; the last step handed to wandb
        self.failed = 0
        self.say = print

    def start(self, run: Start) -> Dict[str, object]:
        import wandb

        self.say = run.say
        run_id = run.kept.get("id") or "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
        try:
            self.run = wandb.init(project=self.cfg.project or run.name, entity=self.cfg.entity, mode=self.cfg.mode,
                                  name=self.cfg.run_name or run.name, group=self.cfg.group, dir=str(run.run_dir), id=run_id,
                                  resume="allow", settings=wandb.Settings(console="off", quiet=True))
            # On a resume the effective values may differ (another world size): the latest are kept.
            self.run.config.update(run.config, allow_val_change=True)
        except Exception as e:  # not logged in, an unknown entity, a server that cannot be reached
            raise UserError(f"logging.wandb: {first_line(e)}; run `wandb login` (or set WANDB_API_KEY), or set "
                            f"logging.wandb.mode=offline, or logging.wandb=null") from None
        self.held = max(int(run.kept.get("held", 0)), self.run.starting_step - 1)
        self.kept = {"id": run_id, "project": self.run.project, "held": self.held}
        return self.kept

    def scalars(self, values: Dict[str, float], step: int) -> None:
        if step <= self.held:
            return
        try:
            self.run.log(values, step=step)
            self.last = step
        except Exception as e:
            self.failed += 1
            if self.failed == 1:
                self.say(f"logging.wandb: could not log step {step} ({first_line(e)}); training goes on, and "
                         f"values that cannot be logged are left out")

    def close(self, status: str) -> Optional[Dict[str, object]]:
        if self.run is None:
            return None
        self.run.finish(exit_code=1 if status == "failed" else 0)  # returns once wandb has written everything
        return {**self.kept, "held": max(self.held, self.last)}
