"""The README is the front door: its commands are the ones CI runs, and its snippets work."""

import re
import subprocess
import sys

from tests.conftest import REPO, train

README = (REPO / "README.md").read_text()
SETUP = 'python -m pip install -c constraints.txt -e'


def test_the_two_commands():
    train_cmd = f"{SETUP} . && python -m launcher recipes/quickstart.yaml"
    test_cmd = f'{SETUP} ".[dev]" && python -m pytest'
    assert train_cmd in README and test_cmd in README
    assert test_cmd in (REPO / ".ci" / "run").read_text()
    assert "torch==2.13.0" in (REPO / "constraints.txt").read_text()


def test_loading_snippet_runs(tmp_path):
    train(tmp_path / "runs" / "quickstart")
    snippet = re.search(r"```python\n(.*?)```", README, re.S).group(1)
    done = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(REPO)!r})\n{snippet}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
