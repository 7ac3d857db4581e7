"""tests/several_runs.py for the planner's accuracy table (tests/test_plan.py): several runs in one torchrun
launch, where only the runs named apart start the memory planner as every run does (`python -m launcher.plan
--as-run` in a process of its own beside training). The others defer it: their command line is written to
deferred.jsonl beside CASES.json when the run asks for its figure (as memory.Planned makes it, the length of the
run's measured batch given, less its --out file), and the test plans it in its
own process (the same `launcher.plan` main on the same arguments, its own --out), while the measured peak is still
the run's own. Each planner process costs a start and an
import of torch; the figure does not depend on which process computes it (the test checks that on the runs
planned apart).

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/plan_runs.py CASES.json APART.json"""

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Set

sys.path.insert(0, os.getcwd())  # run as a script from the repository's root: `launcher` and `recipes` import


def planned_runs(cases: Dict[str, List[str]], apart: Set[str], folder: Path, nproc: int, timeout: float) -> tuple:
    """Run `cases` in one torchrun launch of `nproc` processes, the planner in a process of its own only for the
    cases named in `apart`: (each rank's results, by rank; {case: the planner's arguments, and whether apart})."""
    from tests.conftest import REPO
    from tests.pace import paced

    cases = {name: [str(arg) for arg in args] for name, args in cases.items()}
    (folder / "cases.json").write_text(json.dumps(cases))
    (folder / "apart.json").write_text(json.dumps(sorted(arg for name in apart if name in cases for arg in cases[name]
                                                         if arg.startswith("run_dir="))))
    asked = folder / "deferred.jsonl"
    asked.unlink(missing_ok=True)
    # one process: python itself, as `python -m launcher` runs alone (torchrun's agent would be a second import
    # of torch for nothing)
    launch = [] if nproc == 1 else ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    done = subprocess.run([sys.executable, *launch, "tests/plan_runs.py", str(folder / "cases.json"),
                           str(folder / "apart.json")], cwd=REPO, capture_output=True, text=True,
                          timeout=paced(timeout))
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads((folder / f"cases.rank{rank}.json").read_text()) for rank in range(nproc)]
    by_run_dir = {arg: name for name, args in cases.items() for arg in args if arg.startswith("run_dir=")}
    planners = {}
    for line in asked.read_text().splitlines() if asked.is_file() else []:
        record = json.loads(line)
        (name,) = {by_run_dir[arg] for arg in record["argv"] if arg in by_run_dir}
        planners[name] = record
    return results, planners


def logged(run_dir: Path) -> dict:
    """Each metric's last value in a run's metrics.jsonl (the run's measured peak: memory/peak_bytes)."""
    values = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        values.update(json.loads(line))
    return values


def main(cases_file: str, apart_file: str) -> None:
    from launcher.observe import memory
    from tests.several_runs import main as several

    apart = set(json.loads(Path(apart_file).read_text()))
    asked = Path(cases_file).with_name("deferred.jsonl")
    real = memory.Planned

    class Recorded:
        """memory.Planned, its arguments written when the run asks for its result (the run gives the length of its
        measured batch before); the planner's process only for the runs named apart."""

        def __init__(self, made, own: bool):
            self.made, self.own = made, own
            self.said = False

        def as_measured(self, *measured) -> None:
            self.made.as_measured(*measured)

        def start(self) -> None:
            if self.own:
                self.made.start()

        def ready(self) -> bool:
            return self.own and self.made.ready()

        def result(self, wait: bool) -> tuple:
            with open(asked, "a") as out:  # less `python -m launcher.plan` and its --out FILE (the last one kept)
                out.write(json.dumps({"argv": self.made.args, "apart": self.own}) + "\n")
            if self.own:
                return self.made.result(wait)
            return None, f"memory: planned by the test in its own process ({self.made.command})"

        def assuming(self) -> str:
            return self.made.assuming()

        def close(self) -> None:
            self.made.close()

    def planned(recipe_path, overrides, strategy, world, device_type):
        made = real(recipe_path, overrides, strategy, world, device_type)  # not started: its arguments
        return Recorded(made, bool(apart & set(overrides)))

    memory.Planned = planned
    several(cases_file)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
