"""Several runs in one torchrun launch, one after another on every rank, so that a test of many resumes pays
once for starting the processes and importing torch:

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/several_runs.py CASES.json

CASES.json maps a case's name to its command line after `python -m launcher` (the recipe, then overrides).
Each rank writes CASES.rank<R>.json beside it: for each case, the error it ended with ("Type: first line", or
null) and what it printed. A case that fails on every rank alike (an exception at the same step) lets the
next one run, so that one launch tells every case's outcome. `several(cases, folder)` does all this from a test."""

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

sys.path.insert(0, os.getcwd())  # run as a script from the repository's root: `launcher` and `recipes` import


def several(cases: Dict[str, List[str]], folder: Path, nproc: int = 2, timeout: float = 300) -> List[dict]:
    """Run `cases` in one torchrun launch of `nproc` processes; each rank's results, by rank."""
    from tests.conftest import REPO

    (folder / "cases.json").write_text(json.dumps({name: [str(arg) for arg in args] for name, args in cases.items()}))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                           "tests/several_runs.py", str(folder / "cases.json")], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((folder / f"cases.rank{rank}.json").read_text()) for rank in range(nproc)]


def main(cases_file: str) -> None:
    from launcher.errors import first_line
    from launcher.recipe import load
    from launcher.run.train import train

    cases = json.loads(Path(cases_file).read_text())
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    results = {}
    for name, (recipe, *overrides) in cases.items():
        # The launcher keeps each attempt's process group keys in torchrun's store under the attempt's number
        # (launcher/strategies/ddp.py); a second process group in this process must not read the first's.
        os.environ["TORCHELASTIC_RESTART_COUNT"] = f"{attempt}.{name}"
        said, error = io.StringIO(), None
        with contextlib.redirect_stdout(said):
            try:
                train(load(Path(recipe), overrides))
            except Exception as e:  # noqa: BLE001 - the case's outcome, reported to the test
                error = f"{type(e).__name__}: {first_line(e)}"
        results[name] = {"error": error, "said": said.getvalue()}
        print(said.getvalue(), end="", flush=True)
    rank = os.environ.get("RANK", "0")
    Path(cases_file).with_suffix(f".rank{rank}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    from launcher import collector

    collector.pause()  # as python -m launcher starts: the first run's training resumes it
    main(sys.argv[1])
