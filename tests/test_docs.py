"""The documentation stays true (docs/contributing.md, "Documentation", says the rules this file holds).

The site builds strict; every command of the README and of docs/ is run by a test or marked, on the line
above its block, as one that cannot run here; every command's flags are the command's own, and its recipe and
overrides load; every recipe key has its line of reference and the reverse; every command's --help names its
page; every family of one-line mistakes is on the troubleshooting page. The pages' blocks are run in the slow
tier (`test_a_pages_commands_run`), each in a fresh folder that stands for a clone."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.util
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
import typing
from pathlib import Path
from typing import List, NamedTuple, Optional
from unittest import mock

import pytest
import yaml

from tests.conftest import REPO
from tests.pace import paced

DOCS = REPO / "docs"
PAGES = sorted(p.relative_to(REPO).as_posix() for p in DOCS.glob("*.md")) + ["README.md"]
REASONS = {"gpu": "a CUDA device", "gpus": "several GPUs", "cluster": "Slurm, or several machines",
           "network": "a server elsewhere", "install": "it changes the environment", "server": "it runs until stopped",
           "minutes": "a measurement or a run of minutes", "your-data": "it names files you supply"}
MARKER = re.compile(r"<!-- (not run here|run by|run with): (.+?) -->")


def text(page: str) -> str:
    return (REPO / page).read_text()


# ---- reading the pages ---------------------------------------------------------------------------------------


class Block(NamedTuple):
    page: str
    line: int  # of the opening fence, from 1
    lang: str
    body: str
    marker: Optional[tuple]  # (kind, value) of the comment on the line above, or None


def blocks(page: str) -> List[Block]:
    """Every fenced block of a page, with the marker comment on the line just above it."""
    found, lines, i = [], text(page).splitlines(), 0
    while i < len(lines):
        m = re.match(r"^( *)(```+)(\S*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.groups()
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == fence)
        body = textwrap.dedent("\n".join(lines[i + 1:end]))
        above = lines[i - 1].strip() if i else ""
        marked = MARKER.fullmatch(above)
        if above.startswith("<!--"):
            assert marked, f"{page}:{i}: {above!r} is not a marker this test knows (see docs/contributing.md)"
        found.append(Block(page, i + 1, lang, body, marked.groups() if marked else None))
        i = end + 1
    return found


class Command(NamedTuple):
    argv: List[str]
    redirect: Optional[str]  # `> file`

    def shell(self, extra: List[str] = ()) -> str:
        return shlex.join([*self.argv, *extra]) + (f" > {shlex.quote(self.redirect)}" if self.redirect else "")


def commands(body: str) -> List[Command]:
    """The commands of a shell block: continuation lines joined, comments dropped, `&&` and `;` split."""
    out = []
    for line in body.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split, lexer.commenters = True, "#"
        words, redirect, pending = [], None, False
        for token in [*lexer, "&&"]:
            if token in ("&&", ";"):
                if words:
                    out.append(Command(words, redirect))
                words, redirect = [], None
            elif token == ">":
                pending = True
            elif pending:
                redirect, pending = token, False
            else:
                words.append(token)
    return out


def shell_blocks() -> List[Block]:
    found = [b for page in PAGES for b in blocks(page)]
    odd = [f"{b.page}:{b.line} ```{b.lang}" for b in found if b.lang in ("sh", "shell", "console", "zsh")]
    assert not odd, f"a shell command goes in a ```bash block (these the tests read): {odd}"
    return [b for b in found if b.lang == "bash"]


def inline_commands() -> List[tuple]:
    """(page, argv) of each command written in backticks in the prose: `python -m launcher...`, `torchrun ...`,
    `accelerate launch ...`; placeholders (`...`) are left out."""
    found = []
    for page in PAGES:
        prose = re.sub(r"^( *)```.*?^\1```", "", text(page), flags=re.S | re.M)
        for span in re.findall(r"(?<!`)`([^`]+)`(?!`)", prose):
            span = " ".join(span.split())
            if re.match(r"(python -m launcher\b|torchrun |accelerate launch )", span) and "|" not in span:
                try:
                    argv = shlex.split(span)
                except ValueError:
                    continue
                if not any(a.endswith("...") and a != "..." for a in argv):  # `python -m launcher...`: a family
                    found.append((page, [a for a in argv if a != "..."]))
    return found


# ---- what a command is, and checking its arguments ---------------------------------------------------------


def module_of(argv: List[str]) -> Optional[tuple]:
    """(module, its arguments) of `python -m X ...`, `torchrun ... -m launcher ...`, `accelerate launch ... -m
    launcher ...`; None for other commands."""
    if argv[:2] == ["python", "-m"] and len(argv) > 2:
        return argv[2], argv[3:]
    if argv[:1] == ["torchrun"] or argv[:2] == ["accelerate", "launch"]:
        at = argv.index("-m")
        return argv[at + 1], argv[at + 2:]
    return None


def is_training(argv: List[str]) -> bool:
    found = module_of(argv)
    return bool(found) and found[0] == "launcher" and not {"--help", "--print-config"} & set(found[1])


class _Parsed(Exception):
    def __init__(self, parser, result):
        self.parser, self.result = parser, result


@contextlib.contextmanager
def parse_only(before: bool = False):
    """argparse parses as usual, then the outermost parse raises _Parsed: a command's main() checks its
    arguments with its own parser and does nothing else (before=True: the parser alone, nothing parsed)."""
    names = ("parse_args", "parse_known_args", "parse_intermixed_args", "parse_known_intermixed_args")
    originals, depth = {n: getattr(argparse.ArgumentParser, n) for n in names}, [0]

    def wrap(name):
        def parse(self, *args, **kwargs):
            if before and depth[0] == 0:
                raise _Parsed(self, None)
            depth[0] += 1
            try:
                result = originals[name](self, *args, **kwargs)
            finally:
                depth[0] -= 1
            if depth[0] == 0:
                raise _Parsed(self, result)
            return result
        return parse

    with contextlib.ExitStack() as stack:
        for n in names:
            stack.enter_context(mock.patch.object(argparse.ArgumentParser, n, wrap(n)))
        yield


def main_of(module: str):
    spec = importlib.util.find_spec(module)
    assert spec is not None, f"python -m {module}: no such module"
    mod = importlib.import_module(f"{module}.__main__" if spec.submodule_search_locations else module)
    return mod, mod.__name__


def call_main(module: str, args: List[str]):
    mod, name = main_of(module)
    with mock.patch.object(sys, "argv", [name, *args]):
        return mod.main(args) if mod.main.__code__.co_argcount else mod.main()


def parsed(module: str, args: List[str]) -> _Parsed:
    """The parser of `python -m module args` and what it parsed the arguments into (its main() stops there);
    SystemExit if they are not the command's."""
    with parse_only(), contextlib.redirect_stdout(io.StringIO()):
        try:
            call_main(module, args)
        except _Parsed as done:
            return done
    raise AssertionError(f"python -m {module}: main() did not parse its arguments with argparse")


def flags(args: List[str]) -> List[str]:
    return [a.split("=", 1)[0] for a in args if a.startswith("--")]


def check_recipe(recipe: str, overrides: List[str], loads: bool = True) -> None:
    from launcher.recipe import load

    if loads and recipe.startswith("recipes/") and (REPO / recipe).exists():
        load(REPO / recipe, overrides)


def check(argv: List[str], whole: bool = True, loads: bool = True) -> None:
    """The command's flags are its own, and the recipe and overrides it names load as a run loads them. A
    command in backticks (whole=False) may be part of one (`python -m launcher.export`, `torchrun --max-restarts
    N`): its flags are checked, and what it names."""
    from launcher.errors import UserError

    try:
        _check(argv, whole, loads)
    except (SystemExit, UserError) as e:
        pytest.fail(f"{shlex.join(argv)}: {e}")


def _check(argv: List[str], whole: bool, loads: bool = True) -> None:
    if argv[:4] == ["python", "-m", "pip", "install"]:
        return check_install(argv)
    launcher_at = argv.index("-m") if "-m" in argv else len(argv)
    if argv[:1] == ["torchrun"] or argv[:2] == ["accelerate", "launch"]:
        from accelerate.commands.launch import launch_command_parser
        from torch.distributed.run import get_args_parser

        parser, own = (get_args_parser(), argv[1:launcher_at]) if argv[0] == "torchrun" else \
            (launch_command_parser(), argv[2:launcher_at])
        if whole:
            parser.parse_args([*own, "-m", "launcher"])
        else:
            known = {o for action in parser._actions for o in action.option_strings}
            assert set(flags(own)) <= known, f"{shlex.join(argv)}: {sorted(set(flags(own)) - known)}"
    found = module_of(argv) if launcher_at < len(argv) else None
    if found is None:
        return
    module, args = found
    if not module.startswith(("launcher", "recipes.", "tests.")):
        return
    if module == "launcher":
        assert set(flags(args)) <= {"--help", "--print-config"}, f"{shlex.join(argv)}: {flags(args)}"
        positional = [a for a in args if not a.startswith("-")]
        if positional:
            check_recipe(positional[0], positional[1:], loads)
        return
    if module == "launcher.slurm":
        from launcher.slurm.__main__ import parse

        if not whole and len([a for a in args if not a.startswith("-")]) < 2:
            known = {"--" + f.name.replace("_", "-") for f in dataclasses.fields(__import__(
                "launcher.recipe.schema", fromlist=["SlurmConfig"]).SlurmConfig)} | {"--help"}
            assert set(flags(args)) <= known, f"{shlex.join(argv)}: {sorted(set(flags(args)) - known)}"
            return
        command, recipe, slurm, training = parse(args)
        if command != "help":
            check_recipe(str(recipe), [*training, *slurm], loads)
        return
    spec = importlib.util.find_spec(module)
    assert spec is not None, f"{shlex.join(argv)}: no module {module}"
    source = Path(spec.origin).read_text() if not spec.submodule_search_locations else \
        (Path(spec.origin).parent / "__main__.py").read_text()
    if "ArgumentParser" not in source or (not whole and not args):
        return
    if whole and "--help" not in args:
        done = parsed(module, args)
        if module == "launcher.sweep" and args[:1] != ["report"]:
            from launcher.sweep.plan import plan

            options, rest = done.result
            if loads and (REPO / options.recipe).exists():  # every combination loads, as the sweep loads them
                plan(REPO / options.recipe, [a for a in rest if "=" in a and not a.startswith("-")],
                     options.max_runs, options.yes)
        return
    sub = args[:1] if module == "launcher.sweep" and args[:1] == ["report"] else []
    with parse_only(before=True), contextlib.redirect_stdout(io.StringIO()):
        try:
            call_main(module, sub)
        except _Parsed as done:
            known = {o for action in done.parser._actions for o in action.option_strings}
    if module == "launcher.sweep" and "--slurm" in args:
        known |= {"--" + f.name.replace("_", "-") for f in dataclasses.fields(__import__(
            "launcher.recipe.schema", fromlist=["SlurmConfig"]).SlurmConfig)}
    assert set(flags(args)) <= known, f"{shlex.join(argv)}: {sorted(set(flags(args)) - known)} not among {sorted(known)}"


def check_install(argv: List[str]) -> None:
    """A pip install of this checkout goes through the lock, and its extras exist; torch is the lock's."""
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    if any(a.startswith("torch==") for a in argv):
        pinned = re.search(r"^torch==(\S+)$", (REPO / "constraints.txt").read_text(), re.M).group(1)
        assert f"torch=={pinned}" in argv, f"{shlex.join(argv)}: the lock pins torch=={pinned}"
        return
    assert argv[4:6] == ["-c", "constraints.txt"], f"{shlex.join(argv)}: installs through the lock, -c constraints.txt"
    target = argv[argv.index("-e") + 1]
    named = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", target)
    assert named, f"{shlex.join(argv)}: installs this checkout, -e . or -e '.[extra]'"
    missing = [e for e in (named.group(1) or "").split(",") if e and e not in extras]
    assert not missing, f"{shlex.join(argv)}: no extra {missing} in pyproject.toml"


# ---- the tests -------------------------------------------------------------------------------------------------


def test_the_site_builds_strict(tmp_path):
    """Broken links and anchors, missing pages, pages left out of the nav: mkdocs.yml makes each a warning, and
    --strict a failure."""
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=REPO, capture_output=True, text=True, timeout=paced(120),
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stdout + done.stderr + (
        "\n(mkdocs is in the dev and docs extras: python -m pip install -c constraints.txt -e '.[dev]')")
    nav = yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"]
    assert not {p.name for p in DOCS.glob("*.md")} - set(re.findall(r"[\w-]+\.md", str(nav))), "a page not in the nav"


def anchors(page: Path) -> set:
    from markdown.extensions.toc import slugify

    prose = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    return {slugify(h.replace("`", ""), "-") for h in re.findall(r"^#+ (.+)$", prose, re.M)}


def test_the_readme_is_a_front_door_whose_links_hold():
    readme = text("README.md")
    assert len(readme.splitlines()) <= 250, "README.md: at most 250 lines; the rest belongs on a page of docs/"
    for page in DOCS.glob("*.md"):
        assert f"docs/{page.name}" in readme, f"README.md does not link docs/{page.name}"
    for target, anchor in re.findall(r"\]\(([^)#\s]+\.md)(?:#([\w-]+))?\)", readme):
        assert (REPO / target).exists(), f"README.md links {target}, which is not there"
        assert not anchor or anchor in anchors(REPO / target), f"README.md links {target}#{anchor}: no such heading"


def test_the_readmes_launch_matrix_is_run_or_marked_on_its_pages():
    """One line per way of launching: each command is, as written, a command of a block of the page its row
    links, where it is run or marked."""
    readme = text("README.md")
    matrix = re.search(r"^## Ways of launching\n(.*?)^## ", readme, re.S | re.M).group(1)
    rows = re.findall(r"^\| [^|]+ \| `([^`]+)` \| \[[^\]]+\]\((docs/[\w-]+\.md)#", matrix, re.M)
    assert [shlex.split(c)[:2] for c, _ in rows] == [["python", "-m"], ["torchrun", "--nproc_per_node=4"],
                                                    ["accelerate", "launch"], ["python", "-m"], ["python", "-m"]]
    for command, page in rows:
        on_page = [c.argv for b in blocks(page) if b.lang == "bash" for c in commands(b.body)]
        assert shlex.split(command) in on_page, f"README's `{command}` is not a command of {page}'s blocks"


def test_every_block_command_is_run_or_marked():
    """An unmarked ```bash block is run by test_a_pages_commands_run; a marked one says why not, or which test
    runs it (and that test reads this page)."""
    for block in shell_blocks():
        where = f"{block.page}:{block.line}"
        assert commands(block.body), f"{where}: a ```bash block without a command"
        if block.marker is None:
            continue
        kind, value = block.marker
        if kind == "not run here":
            assert value in REASONS, f"{where}: '{value}' is not one of {sorted(REASONS)}"
        elif kind == "run with":
            assert all(re.fullmatch(r"[\w.]+=\S+", o) for o in value.split()), f"{where}: key=value overrides"
        elif value == ".ci/run":
            ci = [c.argv for c in commands((REPO / ".ci" / "run").read_text())]
            assert all(c.argv in ci for c in commands(block.body)), f"{where}: not what .ci/run runs"
        else:
            path, _, name = value.partition("::")
            source = (REPO / path).read_text()
            assert re.search(rf"^def {re.escape(name)}\(", source, re.M), f"{where}: no test {value}"
            assert Path(block.page).name in source, f"{where}: {path} does not read {block.page}"


def all_commands() -> List[tuple]:
    """(argv, whole, loads) of every command: in blocks (whole) and in backticks (maybe a part of one); loads:
    whether its recipe is loaded here, which the blocks the slow tier runs leave to that run."""
    run = {id(b) for b in runnable()}
    return [*((c.argv, True, id(b) not in run) for b in shell_blocks() for c in commands(b.body)),
            *((argv, False, True) for _, argv in inline_commands())]


def test_every_commands_flags_are_the_commands_own():
    """In blocks and in backticks, run or not: a flag the command lacks (torchrun's and accelerate's too), an
    extra pyproject.toml lacks, a pip install outside the lock, each fails here. Whether its recipe and
    overrides load takes a second a recipe: the slow tier checks that (below)."""
    for argv, whole, _ in all_commands():
        check(argv, whole, loads=False)


@pytest.mark.slow
def test_every_commands_recipe_and_overrides_load():
    """A recipe key that does not exist, a value of the wrong type, a `_target_` argument the component does not
    take: each fails here, for every command that names a recipe, run or not (the sweeps' every combination)."""
    loaded = [check(argv, whole) for argv, whole, loads in all_commands() if loads]
    assert len(loaded) > 20


def runnable() -> List[Block]:
    """The blocks test_a_pages_commands_run runs: unmarked or shortened; a block the same as an earlier one (the
    quickstart's command, on three pages) once."""
    seen, out = set(), []
    for b in shell_blocks():
        what = (b.marker, tuple(c.shell() for c in commands(b.body) if c.argv[:4] != ["python", "-m", "pip", "install"]))
        if (b.marker is None or b.marker[0] == "run with") and what not in seen:
            seen.add(what)
            out.append(b)
    return out


def _lines(block: Block) -> List[tuple]:
    """(line, argv) of each command test_a_pages_commands_run runs for a block, in order (pip installs left out)."""
    extra = block.marker[1].split() if block.marker else []
    out = []
    for command in commands(block.body):
        if command.argv[:4] == ["python", "-m", "pip", "install"]:
            continue
        module = module_of(command.argv)
        shortened = is_training(command.argv) or (module and module[0] == "launcher.sweep" and "report" not in module[1])
        out.append((command.shell(extra if shortened else []), command.argv))
    return out


# A fresh clone after a first command that begins several blocks (the quickstart's run, on three pages), by that
# command's line: the first block that runs it (in this process) keeps a copy of its clone just after it, and
# the others start from that copy instead of running the same command again on the same fresh clone.
_FIRST_DONE: dict = {}
_FIRSTS = [_lines(b)[0][0] for b in runnable() if _lines(b)]
_SHARED_FIRST = {line for line in _FIRSTS if _FIRSTS.count(line) > 1}


@pytest.mark.slow
@pytest.mark.parametrize("block", runnable(), ids=lambda b: f"{b.page}:{b.line}")
def test_a_pages_commands_run(block, tmp_path):
    """The block's commands in order, as a newcomer types them on a fresh clone without a GPU: each exits 0, and
    a training command trains (a run folder an earlier command finished would train nothing). pip installs are
    checked (test_every_commands_flags_...), never run: they would reinstall this checkout. A first command that
    an earlier block began with too ran there on a fresh clone alike: this block starts from what it left."""
    clone = tmp_path / "clone"
    lines = _lines(block)
    shared = lines[0][0] if lines and lines[0][0] in _SHARED_FIRST else None
    if shared in _FIRST_DONE:
        shutil.copytree(_FIRST_DONE[shared], clone, symlinks=True)
        lines = lines[1:]
    else:
        shutil.copytree(REPO, clone, ignore=shutil.ignore_patterns(".git", "runs", "site", "__pycache__", "*.egg-info",
                                                                    ".pytest_cache", ".venv*"))
    bin_dir = str(Path(sys.executable).parent)  # python, torchrun and accelerate of this environment
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(clone),
           "CUDA_VISIBLE_DEVICES": "", "NO_MKDOCS_2_WARNING": "1"}
    for i, (line, argv) in enumerate(lines):
        done = subprocess.run(["bash", "-c", line], cwd=clone, env=env, capture_output=True, text=True, timeout=paced(400))
        said = done.stdout[-3000:] + done.stderr[-3000:]
        assert done.returncode == 0, f"{block.page}:{block.line}: {line}\n{said}"
        if is_training(argv):
            assert "nothing to train" not in said, f"{block.page}:{block.line}: {line} trained nothing\n{said}"
        if i == 0 and line == shared:
            shutil.copytree(clone, tmp_path / "after-first", symlinks=True)
            _FIRST_DONE[shared] = tmp_path / "after-first"


def schema_keys() -> set:
    """Every key of the schema, optional sections' keys included, as the reference names them."""
    from launcher.recipe.reference import keys

    return {key for key, _, _, _ in keys()}


def test_every_recipe_key_has_a_line_of_reference_and_every_line_is_a_key():
    from launcher.recipe import schema

    def walk(cls, prefix=""):
        hints = typing.get_type_hints(cls, vars(schema))
        for f in dataclasses.fields(cls):
            kind = hints[f.name]
            inner = [k for k in typing.get_args(kind) if k is not type(None)]
            section = kind if dataclasses.is_dataclass(kind) else (inner[0] if len(inner) == 1 and
                                                                   dataclasses.is_dataclass(inner[0]) else None)
            if section is None or section is not kind:
                yield prefix + f.name
            if section is not None:
                yield from walk(section, f"{prefix}{f.name}.")

    rows = re.findall(r"^\| `([\w.]+)` \|", text("docs/recipe.md"), re.M)
    assert len(rows) == len(set(rows)), "a key twice in docs/recipe.md"
    documented, defined = set(rows), set(walk(schema.Recipe))
    assert defined - documented == set(), f"keys without a line in docs/recipe.md: {sorted(defined - documented)}"
    assert documented - defined == set(), f"docs/recipe.md lines that are no key: {sorted(documented - defined)}"


def test_a_recipe_key_named_in_a_page_is_one_the_schema_has():
    """`trainer.max_steps`, `data.train.packing=true`, and each override of each command: the section's key must
    exist; below a component (a `_target_`'s arguments) anything goes."""
    from launcher.recipe import schema

    def exists(path: List[str]) -> bool:
        cls = schema.Recipe
        for i, name in enumerate(path):
            fields = {f.name: f for f in dataclasses.fields(cls)}
            if name not in fields:
                return False
            kind = typing.get_type_hints(cls, vars(schema))[name]
            inner = [k for k in typing.get_args(kind) if k is not type(None)]
            nxt = kind if dataclasses.is_dataclass(kind) else (inner[0] if len(inner) == 1 and
                                                               dataclasses.is_dataclass(inner[0]) else None)
            if nxt is None:
                return True  # a leaf, or a component whose arguments are its own
            cls = nxt
        return True

    sections = {f.name for f in dataclasses.fields(schema.Recipe)
                if dataclasses.is_dataclass(typing.get_type_hints(schema.Recipe, vars(schema))[f.name])
                or "Optional[launcher" in str(typing.get_type_hints(schema.Recipe, vars(schema))[f.name])}
    named = [(page, span) for page in PAGES
             for span in re.findall(r"`([a-z_]+(?:\.[a-z_0-9]+)+)(?:[=:][^`]*)?`", text(page))]
    named += [(" ".join(argv), arg.split("=", 1)[0]) for argv, _, _ in all_commands() for arg in argv
              if re.match(r"[a-z_]+(\.[a-z_0-9]+)*=", arg)]  # the commands' key=value overrides
    wrong = [f"{where}: {key}" for where, key in named if key.split(".")[0] in sections and not exists(key.split("."))]
    top = {f.name for f in dataclasses.fields(schema.Recipe)}
    wrong += [f"{where}: {key}" for where, key in named if "." not in key and key not in top
              and re.fullmatch(r"[a-z_]+", key) and (where.startswith("python -m launcher ") or " -m launcher " in where)]
    assert not wrong, f"keys no recipe has: {wrong}"


# The page that explains each command.
HELP = {
    ("launcher", "--help"): "docs/launching.md",
    ("launcher.slurm", "--help"): "docs/slurm-and-sweeps.md",
    ("launcher.slurm", "submit", "--help"): "docs/slurm-and-sweeps.md",
    ("launcher.slurm", "render", "--help"): "docs/slurm-and-sweeps.md",
    ("launcher.sweep", "--help"): "docs/slurm-and-sweeps.md",
    ("launcher.sweep", "report", "--help"): "docs/slurm-and-sweeps.md",
    ("launcher.export", "--help"): "docs/checkpoints.md",
    ("launcher.bench", "--help"): "docs/performance.md",
    ("launcher.bench.gpu", "--help"): "docs/performance.md",
    ("launcher.bench.checksum", "--help"): "docs/performance.md",
    ("launcher.bench.raw_gpt", "--help"): "docs/performance.md",
    ("recipes.components.hf_folder", "--help"): "docs/fine-tuning.md",
    ("recipes.components.chat_data", "--help"): "docs/text-data.md",
    ("recipes.components.pair_data", "--help"): "docs/text-data.md",
    ("launcher.plan", "--help"): "docs/planning.md",
    ("launcher.ft", "--help"): "docs/fault-tolerance.md",
}


def help_of(module: str, args: List[str]) -> str:
    spec = importlib.util.find_spec(module)
    name = f"{module}.__main__" if spec.submodule_search_locations else module
    mod = importlib.import_module(name)
    out = io.StringIO()
    with mock.patch.object(sys, "argv", [name, *args]), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(io.StringIO()):
        try:
            code = mod.main(args) if mod.main.__code__.co_argcount else mod.main()
        except SystemExit as e:
            code = e.code
    assert code in (0, None), f"python -m {module} {' '.join(args)}: exit {code}"
    return out.getvalue()


@pytest.mark.parametrize("command", list(HELP), ids=" ".join)
def test_every_commands_help_names_the_page_that_explains_it(command):
    page = HELP[command]
    said = help_of(command[0], list(command[1:]))
    named = re.findall(r"docs/[\w-]+\.md(?:#[\w-]+)?", said)
    assert any(n.split("#")[0] == page for n in named), f"python -m {' '.join(command)} does not name {page}:\n{said}"
    for n in named:
        target, _, anchor = n.partition("#")
        assert (REPO / target).exists() and (not anchor or anchor in anchors(REPO / target)), f"{n}: not there"


def test_the_launchers_help_lists_every_command_of_the_package():
    """`python -m launcher --help` is where a newcomer finds the other commands: each of the package's own (a
    module or package right under launcher/, and the GPU bench) is listed there. Before, launcher.ft was not."""
    said = help_of("launcher", ["--help"])
    listed = set(re.findall(r"^  python -m (launcher[\w.]*) ", said, re.M))
    ours = {c[0] for c in HELP if c[0].count(".") <= 1 and c[0].startswith("launcher")} | {"launcher.bench.gpu"}
    assert ours - listed == set(), f"python -m launcher --help does not list {sorted(ours - listed)}"


def test_every_command_a_module_defines_is_in_the_help_table():
    """A module of launcher/ or recipes/ that parses a command line is a command: its --help must name a page."""
    modules = {c[0] for c in HELP}
    for path in [*(REPO / "launcher").rglob("*.py"), *(REPO / "recipes").rglob("*.py")]:
        if "ArgumentParser(" in path.read_text():
            module = ".".join(path.relative_to(REPO).with_suffix("").parts)
            module = {"launcher.cli": "launcher", "launcher.sweep.report": "launcher.sweep"}.get(
                module, module.removesuffix(".__main__"))
            assert module in modules, f"{path.relative_to(REPO)} parses a command line: add it to HELP here"


def test_every_family_of_one_line_mistakes_is_on_the_troubleshooting_page():
    page = text("docs/troubleshooting.md")
    named = re.findall(r"`(launcher/[\w/.]+)`", page.split("## One-line mistakes", 1)[1])
    for path in (REPO / "launcher").rglob("*.py"):
        rel = path.relative_to(REPO).as_posix()
        if rel != "launcher/errors.py" and "UserError(" in path.read_text():
            assert any(rel == n or (n.endswith("/") and rel.startswith(n)) for n in named), \
                f"{rel} raises one-line mistakes: name it in a family of docs/troubleshooting.md"
    for n in named:
        assert (REPO / n).exists(), f"docs/troubleshooting.md names {n}, which is not there"


def test_the_readmes_headline_figures_are_the_performance_pages():
    readme = text("README.md")
    figures = re.search(r"^## Headline figures\n(.*)", readme, re.S | re.M).group(1)
    performance = text("docs/performance.md")
    shown = re.findall(r"\*\*([\d.]+)\*\* \(([\d.]+–[\d.]+)\)", figures)
    assert len(shown) >= 5
    for figure, spread in shown:
        assert f"**{figure}** ({spread})" in performance, f"README's {figure} ({spread}) is not on the performance page"
    for command in re.findall(r"`(python -m launcher\.bench[^`]*)`", figures):
        assert command in " ".join(performance.split()), f"README's `{command}` is not on the performance page"


def test_the_layout_names_every_piece_of_the_package():
    layout = re.search(r"^## Layout\n(.*?)^## ", text("docs/contributing.md"), re.S | re.M).group(1)
    for entry in sorted((REPO / "launcher").iterdir()):
        if entry.name.startswith(("_", ".")) and entry.name != "__main__.py":
            continue
        name = entry.name + ("/" if entry.is_dir() else "")
        assert re.search(rf"(?<![\w/.]){re.escape(name)}", layout), f"docs/contributing.md's layout lacks {name}"
