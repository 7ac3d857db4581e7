"""`python -m launcher recipe.yaml key=value ...`"""

import os
import sys

from launcher.cli import main

if __name__ == "__main__":
    code = main()
    base = sys.modules.get("launcher.strategies.base")
    if base is not None and base.ended_a_process_group:
        # Everything is written and closed and the process group destroyed, yet gloo's threads can still
        # hold work whose tensors the interpreter's finalization frees without the GIL: torch 2.13 then
        # aborts the rank at exit ("terminate called without an active exception", about one run in 30)
        # and torchrun reports a finished run as failed. A rank therefore leaves without finalization.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
