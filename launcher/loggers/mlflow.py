"""`logging.mlflow`: one MLflow run per run folder, continued across resumes and Slurm requeues.

Through MlflowClient with an explicit run id (not mlflow.start_run's global active run): parameters are
the flat recipe with the effective values, recipe.yaml is an artifact, values are logged in one
log_batch per log step. The run's id is kept in <run_dir>/trackers.json.
"""

from __future__ import annotations

import os
import time
from typing import Dict, List, Optional

from launcher.errors import UserError, first_line
from launcher.loggers import Start, Unsent

STATUS = {"finished": "FINISHED", "stopped": "KILLED", "failed": "FAILED"}
PACKAGE = ("mlflow", "mlflow-skinny")
MAX_PARAM = 6000  # characters of a parameter's value that MLflow stores
BATCH = 100  # parameters per log_batch


def backend(section, run_dir):
    return MLflow(section)


class MLflow:
    key = "mlflow"
    continues = True

    def __init__(self, cfg):
        self.cfg = cfg
        self.client = self.run_id = self.unsent = None
        self.failed = 0
        self.say = print

    def start(self, run: Start) -> Dict[str, str]:
        from mlflow import MlflowClient
        from mlflow.entities import Param

        self.say = run.say
        uri = self.cfg.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or f"file:{os.path.abspath('mlruns')}"
        if uri.startswith("file:") or "://" not in uri:
            # MLflow 3 keeps its file store for reading only unless asked: a recipe naming one asks.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        try:
            self.client = MlflowClient(tracking_uri=uri, registry_uri=uri)
            self.run_id = self._continued(run) or self._new(run)
            held = self.client.get_run(self.run_id).data
            sent = dict(run.sent)
            for tag in held.metrics:  # what the store holds, not only what the record says
                steps = [m.step for m in self.client.get_metric_history(self.run_id, tag)]
                sent[tag] = max([sent.get(tag, 0), *steps])
            self.unsent = Unsent(sent)
            params = self._params(run, held.params)
            for i in range(0, len(params), BATCH):
                self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in params[i:i + BATCH]])
            self.client.log_text(self.run_id, run.recipe_yaml, "recipe.yaml")
        except UserError:
            raise
        except Exception as e:  # MLflow's own errors, and a server that cannot be reached
            raise UserError(f"logging.mlflow: {uri}: {first_line(e)}; check logging.mlflow.tracking_uri "
                            f"(or MLFLOW_TRACKING_URI), or set logging.mlflow=null") from None
        return {"run_id": self.run_id, "tracking_uri": uri}

    def _continued(self, run: Start) -> Optional[str]:
        run_id = run.kept.get("run_id")
        if not run_id:
            return None
        try:
            self.client.get_run(run_id)
        except Exception:  # another store than the one that run is in: a new run, said so
            run.say(f"logging.mlflow: run {run_id} is not in {self.client.tracking_uri}; starting a new MLflow run")
            return None
        self.client.update_run(run_id, status="RUNNING")
        return run_id

    def _new(self, run: Start) -> str:
        name = self.cfg.experiment or run.name
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        created = self.client.create_run(experiment_id, run_name=self.cfg.run_name or run.name,
                                         tags={"launcher.run_dir": str(run.run_dir.resolve())})
        return created.info.run_id

    def _params(self, run: Start, held: Dict[str, str]) -> List[tuple]:
        """Parameters not held yet. MLflow refuses to change one: a value that changed at a resume (the
        world size, say) goes in as `key at step N`."""
        out = []
        for key, value in run.hparams.items():
            value = str(value)[:MAX_PARAM]
            if key not in held:
                out.append((key, value))
            elif held[key] != value and f"{key} at step {run.step}" not in held:
                out.append((f"{key} at step {run.step}", value))
        return out

    def scalars(self, values: Dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        fresh = self.unsent(values, step)
        if not fresh:
            return
        now = int(time.time() * 1000)
        try:
            self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in fresh.items()])
        except Exception as e:  # a tracking server gone for a while must not end hours of training
            self.failed += 1
            if self.failed == 1:
                self.say(f"logging.mlflow: could not log step {step} ({first_line(e)}); training goes on, and "
                         f"values that cannot be logged are left out")

    def close(self, status: str) -> None:
        if self.run_id is not None:
            try:
                self.client.set_terminated(self.run_id, STATUS[status])
            except Exception as e:
                self.say(f"logging.mlflow: could not mark run {self.run_id} {STATUS[status]}: {first_line(e)}")
