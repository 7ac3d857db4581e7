"""`logging.mlflow`: one MLflow run per run folder, continued across resumes and Slurm requeues.

Through MlflowClient with an explicit run id (not mlflow.start_run's global active run): parameters are
the flat recipe with the effective values, recipe.yaml is an artifact, values are logged in one
log_batch per log step. The run's id is kept in <run_dir>/trackers.json; on resume, the steps the
run's store already holds are not sent again.

The loop never waits on the tracking server: values go to it from a thread of their own, in order.
MLflow retries a failing request for about four minutes (a server's rate limits), which during
training is the thread's time, not the loop's. At the start, a server that cannot be reached is a
mistake to report in seconds: there MLflow retries twice (unless MLFLOW_HTTP_REQUEST_* say otherwise).

Runs that start side by side (a sweep's `--parallel`) may each find their experiment missing: creating it is
idempotent (the run whose creation the store refuses as existing takes the experiment the other created), and
on a local file store, whose own check-then-create could make two experiments of one name, they take turns.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import queue
import re
import threading
import time
from typing import Dict, Iterator, List, Optional

from launcher.errors import UserError, first_line
from launcher.loggers import Start

STATUS = {"finished": "FINISHED", "stopped": "KILLED", "failed": "FAILED"}
PACKAGE = ("mlflow", "mlflow-skinny")
MAX_PARAM = 6000  # characters of a parameter's value that MLflow stores
BATCH = 100  # parameters per log_batch
PENDING = 1000  # log steps waiting for the server; beyond it, values are left out (said once)
CLOSE_WAIT = 30.0  # seconds the end of a run waits for the server to take what is pending
QUICK = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
         "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}


def backend(section, run_dir):
    return MLflow(section)


class MLflow:
    key = "mlflow"
    continues = True

    def __init__(self, cfg):
        self.cfg = cfg
        self.client = self.run_id = self.sender = None
        self.held: Dict[str, int] = {}  # tag -> the last step the run's store holds
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
            with _quick():
                self.client = MlflowClient(tracking_uri=uri, registry_uri=uri)
                self.run_id = self._continued(run) or self._new(run)
                held = self.client.get_run(self.run_id).data
                for tag in held.metrics:  # what the store holds: it alone knows what a killed run sent
                    self.held[tag] = max(m.step for m in self.client.get_metric_history(self.run_id, tag))
                params = self._params(run, held.params)
                for i in range(0, len(params), BATCH):
                    self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in params[i:i + BATCH]])
                self.client.log_text(self.run_id, run.recipe_yaml, "recipe.yaml")
        except UserError:
            raise
        except Exception as e:  # MLflow's own errors, and a server that cannot be reached
            raise UserError(f"logging.mlflow: {uri}: {_reason(e)}; check logging.mlflow.tracking_uri "
                            f"(or MLFLOW_TRACKING_URI), or set logging.mlflow=null") from None
        self.sender = Sender(self.say)
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
        created = self.client.create_run(self._experiment(self.cfg.experiment or run.name),
                                         run_name=self.cfg.run_name or run.name,
                                         tags={"launcher.run_dir": str(run.run_dir.resolve())})
        return created.info.run_id

    def _experiment(self, name: str) -> str:
        """The id of experiment `name`, created if it is missing (the module's docstring: side by side)."""
        from mlflow.exceptions import MlflowException

        with _turn(self.client.tracking_uri):
            found = self.client.get_experiment_by_name(name)
            if found is not None:
                return found.experiment_id
            try:
                return self.client.create_experiment(name)
            except MlflowException as e:  # created by another run since the lookup
                found = self.client.get_experiment_by_name(name) if e.error_code == "RESOURCE_ALREADY_EXISTS" else None
                if found is None:
                    raise
                return found.experiment_id

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

        fresh = {tag: value for tag, value in values.items() if step > self.held.get(tag, 0)}
        if fresh:
            now = int(time.time() * 1000)
            metrics = [Metric(k, float(v), now, step) for k, v in fresh.items()]
            self.sender.send(f"step {step}", self.client.log_batch, self.run_id, metrics=metrics)

    def close(self, status: str) -> None:
        if self.sender is None:
            return
        self.sender.send(f"the run's status ({STATUS[status]})", self.client.set_terminated, self.run_id,
                         STATUS[status])
        self.sender.finish(CLOSE_WAIT)


class Sender:
    """One daemon thread that makes the calls to the tracking server in order, so that the loop never
    waits on it. The first call that fails costs a line (the rest are counted); the end of a run waits
    a bounded time for what is pending, and says what it leaves."""

    def __init__(self, say):
        self.say = say
        self.calls: "queue.Queue" = queue.Queue()
        self.failed, self.dropped = 0, 0
        self.error: Optional[tuple] = None  # (what, why) of the first call that failed
        self.said = False
        self.thread = threading.Thread(target=self._work, name="launcher-mlflow", daemon=True)
        self.thread.start()

    def send(self, what: str, call, *args, **kwargs) -> None:
        self._report()
        if self.calls.qsize() >= PENDING:
            self.dropped += 1
            if self.dropped == 1:
                self.say(f"logging.mlflow: the tracking server has not taken the last {PENDING} log steps; "
                         f"{what} and later ones are left out until it catches up; training goes on")
            return
        self.calls.put((what, call, args, kwargs))

    def _work(self) -> None:
        while True:
            what, call, args, kwargs = self.calls.get()
            try:
                call(*args, **kwargs)
            except Exception as e:  # a server gone for a while must not end hours of training
                self.failed += 1
                self.error = self.error or (what, _reason(e))
            finally:
                self.calls.task_done()

    def _report(self) -> None:
        if self.error and not self.said:
            what, reason = self.error
            self.say(f"logging.mlflow: could not log {what} ({reason}); training goes on, and values that cannot "
                     f"be logged are left out")
            self.said = True

    def finish(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while self.calls.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.02)
        self._report()
        left = self.calls.unfinished_tasks
        if left:
            self.say(f"logging.mlflow: the tracking server did not take the last {left} calls within {seconds:g} s; "
                     f"they are left out")


@contextlib.contextmanager
def _turn(uri: str) -> Iterator[None]:
    """Held while a run looks up and creates its experiment in the local file store at `uri` (a record lock on
    a file in the store's folder, blocking); other stores refuse a second experiment of one name themselves."""
    from mlflow.utils.file_utils import local_file_uri_to_path
    from mlflow.utils.uri import is_local_uri

    if not is_local_uri(uri):
        yield
        return
    root = local_file_uri_to_path(uri)
    os.makedirs(root, exist_ok=True)
    fd = os.open(os.path.join(root, ".launcher.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX)
        except OSError as e:  # a file system without locks (some network mounts): MLflow's own check alone
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
        yield
    finally:
        os.close(fd)  # (closing releases the lock)


@contextlib.contextmanager
def _quick() -> Iterator[None]:
    """MLflow's few retries for the start (the user's MLFLOW_HTTP_REQUEST_* settings win)."""
    added = {k: v for k, v in QUICK.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def _reason(e: Exception) -> str:
    """MLflow's message, or of a connection that failed, its cause alone (urllib3's is hundreds of characters)."""
    text = str(e)
    cause = re.search(r"\[Errno -?\d+\][^'\")]*", text)
    if cause and ("Connection" in text or "Max retries" in text):
        return f"cannot be reached ({cause.group(0).strip()})"
    line = first_line(e)
    return line if len(line) <= 300 else line[:297] + "..."
