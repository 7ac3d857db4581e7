"""Several `python -m MODULE ARGS` commands, one after another in ONE process, so that a test of many commands
that each end before training pays once for importing torch:

    python tests/commands_in_one_process.py CASES.json

CASES.json is a list of command lines after `python -m` (the module, then its arguments); the module is
`launcher` or another whose main(argv) returns the exit code. For each, in order, this prints one line of
JSON to stdout: {"code": its exit code, "stderr": what it wrote to stderr}. A command that blocks or fills
the memory blocks or fails the whole process, as it would its own: the test's limits hold it."""

import contextlib
import importlib
import io
import json
import os
import sys

sys.path.insert(0, os.getcwd())  # run as a script from the repository's root: `launcher` and `recipes` import


def main(cases_file: str) -> None:
    for module, *args in json.load(open(cases_file)):
        main_of = importlib.import_module("launcher.cli" if module == "launcher" else module).main
        said = io.StringIO()
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = main_of(args)
            except SystemExit as e:  # argparse's errors, as `python -m` ends with them
                code = e.code
        print(json.dumps({"code": code, "stderr": said.getvalue()}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
