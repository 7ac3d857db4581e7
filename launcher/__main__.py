"""`python -m launcher recipe.yaml key=value ...`"""

import sys

from launcher.cli import main

if __name__ == "__main__":
    sys.exit(main())
