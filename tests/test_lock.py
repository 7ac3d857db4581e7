"""constraints.txt is the lock (DESIGN's invariant 14): every package that `pip install -e ".[dev]"` installs,
transitive ones included, is pinned there, and this environment, installed through it as CI and the README
install, holds exactly those versions. A dependency added to pyproject.toml without `bash .ci/lock` fails here."""

import re
from importlib import metadata

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.conftest import REPO


def lock() -> dict:
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, eq, version = line.partition("==")
            assert eq and re.fullmatch(r"[A-Za-z0-9_.\-]+", name), f"constraints.txt: {line!r} is not name==version"
            assert canonicalize_name(name) not in pins, f"constraints.txt pins {name} twice"
            pins[canonicalize_name(name)] = Version(version)
    return pins


def installed_closure(root: str, extras: set) -> dict:
    """Each distribution the root needs with these extras, transitively (markers evaluated here): name -> version."""
    seen, todo = {}, [(root, frozenset(extras))]
    while todo:
        name, wanted = todo.pop()
        dist = metadata.distribution(name)
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in (wanted or {""})):
                continue
            key = canonicalize_name(req.name)
            if key not in seen:
                seen[key] = Version(metadata.version(req.name))
                todo.append((req.name, frozenset(req.extras)))
    return seen


def test_every_package_the_dev_install_holds_is_pinned_at_its_installed_version():
    pins, needed = lock(), installed_closure("launcher", {"dev"})
    assert len(needed) > 50  # torch, omegaconf, transformers, mlflow, wandb, datasets ... and theirs
    unpinned = sorted(name for name in needed if name not in pins)
    moved = sorted(f"{name} {version} (the lock: {pins[name]})" for name, version in needed.items()
                   if name in pins and Version(version.public) != pins[name])
    assert not unpinned, f"not in constraints.txt (refresh the lock: bash .ci/lock): {unpinned}"
    assert not moved, f"installed at another version than the lock's (pip install -c constraints.txt): {moved}"


def test_the_lock_keeps_the_tested_torch_and_the_readme_installs_that_torch():
    assert lock()["torch"] == Version("2.13.0")
    assert "python -m pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in (
        REPO / "README.md").read_text()
