"""`python -m launcher recipe.yaml key=value ...`"""

import atexit
import os
import sys

from launcher import collector

collector.pause()  # while torch and the recipe's libraries import; training resumes it (launcher/collector.py)

from launcher.cli import main  # noqa: E402

if __name__ == "__main__":
    code = main()
    base = sys.modules.get("launcher.strategies.base")
    sys.stdout.flush()
    sys.stderr.flush()
    if base is not None and base.ended_a_process_group:
        # Everything is written and closed and the process group destroyed, yet gloo's threads can still
        # hold work whose tensors the interpreter's finalization frees without the GIL: torch 2.13 then
        # aborts the rank at exit ("terminate called without an active exception", about one run in 30)
        # and torchrun reports a finished run as failed. A rank therefore leaves without finalization.
        os._exit(code)
    # An outcome, not a traceback: everything is written and closed. The exit handlers run (loggers'
    # libraries, multiprocessing's children), then the process leaves without tearing down torch's
    # modules one by one, which takes longer than a short run's training (0.7 s of a 3 s one-step run).
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
