"""Several runs in one torchrun launch, one after another on every rank, so that a test of many resumes pays
once for starting the processes and importing torch:

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/several_runs.py CASES.json

CASES.json maps a case's name to its command line after `python -m launcher` (the recipe, then overrides).
Each rank writes CASES.rank<R>.json beside it: for each case, the error it ended with ("Type: first line", or
null) and what it printed. A case that fails on every rank alike (an exception at the same step) lets the
next one run, so that one launch tells every case's outcome. `several(cases, folder)` does all this from a test.

Two ranks, the common case, are a pool that a pytest process starts once and keeps: its torchrun launch
(`tests/several_runs.py --serve FOLDER PID`) waits for job files in FOLDER and runs each job's cases as above,
in the environment of the test that sent it, until PID (the pytest process) is gone. A test that is about the
launch itself (a rank killed, a signal, torchrun's report) starts its own processes, not these."""

import atexit
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

sys.path.insert(0, os.getcwd())  # run as a script from the repository's root: `launcher` and `recipes` import


def several(cases: Dict[str, List[str]], folder: Path, nproc: int = 2, timeout: float = 300) -> List[dict]:
    """Run `cases` in one torchrun launch of `nproc` processes; each rank's results, by rank (`timeout`: seconds on a
    quiet machine, paced)."""
    from tests.conftest import REPO
    from tests.pace import paced

    cases_file = folder / "cases.json"
    cases_file.write_text(json.dumps({name: [str(arg) for arg in args] for name, args in cases.items()}))
    results = [cases_file.with_suffix(f".rank{rank}.json") for rank in range(nproc)]
    for result in results:
        result.unlink(missing_ok=True)
    if nproc == 2:
        Pool.get().run(cases_file, results, paced(timeout))
    else:
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               f"--nproc_per_node={nproc}", "tests/several_runs.py", str(cases_file)], cwd=REPO,
                              capture_output=True, text=True, timeout=paced(timeout))
        assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(result.read_text()) for result in results]


class Pool:
    """Two ranks under torchrun, kept by this pytest process for its several() calls of two processes."""

    _this: Optional["Pool"] = None
    LEFT_ALONE = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")

    @classmethod
    def get(cls) -> "Pool":
        if cls._this is None or cls._this.process.poll() is not None:
            cls._this = Pool()
        return cls._this

    def __init__(self):
        from tests.conftest import REPO

        self.folder = Path(tempfile.mkdtemp(prefix="rank-pool-"))
        self.env = self.environment()
        self.log = self.folder / "log"
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                 "tests/several_runs.py", "--serve", str(self.folder), str(os.getpid())],
                cwd=REPO, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env,
                start_new_session=True)
        self.jobs = 0
        atexit.register(self.close)

    @classmethod
    def environment(cls) -> Dict[str, str]:
        """This process's environment, less what torchrun sets for its ranks and what pytest sets for its test."""
        return {k: v for k, v in os.environ.items() if k not in cls.LEFT_ALONE and not k.startswith("PYTEST_")}

    def run(self, cases_file: Path, results: List[Path], timeout: float) -> None:
        env = self.environment()
        self.jobs += 1
        job = {"cases": str(cases_file), "set": {k: v for k, v in env.items() if self.env.get(k) != v},
               "unset": [k for k in self.env if k not in env]}
        written = self.folder / f".job-{self.jobs}.json"
        written.write_text(json.dumps(job))
        written.rename(self.folder / f"job-{self.jobs}.json")
        start = self.log.stat().st_size
        deadline = time.monotonic() + timeout
        while not all(result.exists() for result in results):
            if self.process.poll() is not None or time.monotonic() > deadline:
                how = (f"exited with {self.process.returncode}" if self.process.poll() is not None
                       else f"took more than {timeout:.0f} s")
                said = self.log.read_text(errors="replace")[start:][-3000:]
                self.close()
                Pool._this = None
                raise AssertionError(f"the pool of two ranks {how} on {cases_file}:\n{said}")
            time.sleep(0.02)

    def close(self) -> None:
        if self.process.poll() is None:
            (self.folder / "stop").touch()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, 9)
                self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def main(cases_file: str, tag: str = "") -> None:
    from launcher.errors import first_line
    from launcher.recipe import load
    from launcher.run.train import train

    cases = json.loads(Path(cases_file).read_text())
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    results = {}
    for name, (recipe, *overrides) in cases.items():
        # The launcher keeps each attempt's process group keys in torchrun's store under the attempt's number
        # (launcher/strategies/ddp.py); a second process group in this process must not read the first's.
        os.environ["TORCHELASTIC_RESTART_COUNT"] = f"{attempt}.{tag}{name}"
        said, error = io.StringIO(), None
        with contextlib.redirect_stdout(said):
            try:
                train(load(Path(recipe), overrides))
            except Exception as e:  # noqa: BLE001 - the case's outcome, reported to the test
                error = f"{type(e).__name__}: {first_line(e)}"
        results[name] = {"error": error, "said": said.getvalue()}
        print(said.getvalue(), end="", flush=True)
    rank = os.environ.get("RANK", "0")
    written = Path(cases_file).with_suffix(f".rank{rank}.partial")
    written.write_text(json.dumps(results, indent=1))
    written.rename(Path(cases_file).with_suffix(f".rank{rank}.json"))


def serve(folder: Path, owner: int) -> None:
    """The pool's rank: each job in turn (job-1.json, job-2.json, ...) in the environment its test had, until
    the owner (the pytest process) is gone or says stop."""
    base, number = dict(os.environ), 0
    while True:
        number += 1
        job = folder / f"job-{number}.json"
        while not job.exists():
            if (folder / "stop").exists() or not _alive(owner):
                return
            time.sleep(0.02)
        spec = json.loads(job.read_text())
        os.environ.update(spec["set"])
        for key in spec["unset"]:
            os.environ.pop(key, None)
        try:
            main(spec["cases"], tag=f"{number}.")
        finally:
            os.environ.clear()
            os.environ.update(base)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


if __name__ == "__main__":
    from launcher import collector

    collector.pause()  # as python -m launcher starts: the first run's training resumes it
    if sys.argv[1] == "--serve":
        serve(Path(sys.argv[2]), int(sys.argv[3]))
    else:
        main(sys.argv[1])
