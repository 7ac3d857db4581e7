"""The README is the front door: its commands are the ones CI runs, and its snippets work."""

import dataclasses
import re
import subprocess
import sys
import typing

import yaml
from omegaconf import OmegaConf

from tests.conftest import QUICKSTART, REPO, train

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


def readme_recipe() -> str:
    """The README's recipe block: the ```yaml block that starts with a comment naming recipes/quickstart.yaml."""
    return re.search(r"```yaml\n(# recipes/quickstart\.yaml.*?)```", README, re.S).group(1)


def settings(text: str) -> list[str]:
    """A recipe's key/value lines, without comments or blank lines, spacing after the indent collapsed."""
    lines = [re.sub(r"\s+#.*$", "", line) for line in text.splitlines() if not line.lstrip().startswith("#")]
    return [line[:len(line) - len(line.lstrip())] + " ".join(line.split()) for line in lines if line.strip()]


def schema_keys(schema, prefix: str = "") -> list[str]:
    """Every key of the schema: the sections' keys, and (not their arguments) the components'."""
    keys = []
    for f in dataclasses.fields(schema):
        kind = typing.get_type_hints(schema)[f.name]
        keys += schema_keys(kind, f"{prefix}{f.name}.") if dataclasses.is_dataclass(kind) else [prefix + f.name]
    return keys


def dotted_keys(mapping: dict, prefix: str = "") -> set[str]:
    keys = set()
    for key, value in mapping.items():
        keys.add(prefix + key)
        if isinstance(value, dict):
            keys |= dotted_keys(value, f"{prefix}{key}.")
    return keys


def leaves(mapping: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in mapping.items():
        out.update(leaves(value, f"{prefix}{key}.") if isinstance(value, dict) and value else {prefix + key: value})
    return out


def test_the_recipe_block_is_the_shipped_quickstart_with_every_default(tmp_path):
    """The rule: (1) the shipped recipe's own lines appear in the block, in order, as written (comments and
    the spacing after a key aside); (2) the block, loaded as a recipe, resolves to exactly what the shipped
    recipe resolves to, so each added line shows the schema's default; (3) it names every key of the schema."""
    from launcher.recipe import Recipe, load

    block = readme_recipe()
    shipped = settings(QUICKSTART.read_text())
    shown = settings(block)
    at = 0
    for line in shipped:
        assert line in shown[at:], f"recipes/quickstart.yaml's line {line!r} is not in the README's block (in order)"
        at = shown.index(line, at) + 1
    (tmp_path / "readme.yaml").write_text(block)
    as_shown = leaves(OmegaConf.to_container(load(tmp_path / "readme.yaml").config))
    expected = leaves(OmegaConf.to_container(load(QUICKSTART).config))
    differ = [f"{k}: README {as_shown.get(k)!r}, shipped or default {expected.get(k)!r}"
              for k in sorted(as_shown.keys() | expected.keys()) if as_shown.get(k, ...) != expected.get(k, ...)]
    assert not differ, "the README's recipe block differs from recipes/quickstart.yaml: " + "; ".join(differ)
    missing = [key for key in schema_keys(Recipe) if key not in dotted_keys(yaml.safe_load(block))]
    assert not missing, f"the README's recipe block lacks {missing}"


def test_the_recipe_reference_is_current_and_says_what_each_key_does():
    from launcher.recipe import Recipe
    from launcher.recipe.reference import keys, render

    assert (REPO / "docs" / "recipe.md").read_text() == render(), \
        "docs/recipe.md is stale: python -m launcher.recipe.reference > docs/recipe.md"
    rows = {key: (kind, default, meaning) for key, kind, default, meaning in keys()}
    assert set(schema_keys(Recipe)) <= set(rows)
    assert not [key for key, (_, _, meaning) in rows.items() if len(meaning) < 8], "keys without a meaning"
    assert "docs/recipe.md" in README
