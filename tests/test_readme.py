"""The README is the front door: its commands are the ones CI runs, and its snippets work; so do the pages of
docs/ it sends a reader to (tests/test_docs.py checks the rest of them)."""

import dataclasses
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import textwrap
import typing

import pytest
import yaml
from omegaconf import OmegaConf

from tests.conftest import QUICKSTART, REPO, train
from tests.pace import paced

README = (REPO / "README.md").read_text()


def page(name: str) -> str:
    """A page of docs/, e.g. page("fine-tuning.md")."""
    return (REPO / "docs" / name).read_text()
SETUP = 'python -m pip install -c constraints.txt -e'


def test_the_two_commands():
    train_cmd = f"{SETUP} . && python -m launcher recipes/quickstart.yaml"
    test_cmd = f'{SETUP} ".[dev]" && python -m pytest'
    assert train_cmd in README and test_cmd in README
    assert test_cmd in (REPO / ".ci" / "run").read_text()
    assert "torch==2.13.0" in (REPO / "constraints.txt").read_text()


def test_loading_snippet_runs(tmp_path):
    """docs/checkpoints.md's snippet that loads model.pt into the plain model."""
    train(tmp_path / "runs" / "quickstart")
    snippet = re.search(r"```python\n(.*?)```", page("checkpoints.md"), re.S).group(1)
    done = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(REPO)!r})\n{snippet}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=paced(60))
    assert done.returncode == 0, done.stderr


def quickstart_block(text: str) -> str:
    """A page's recipe block: the ```yaml block that starts with a comment naming recipes/quickstart.yaml."""
    return re.search(r"```yaml\n(# recipes/quickstart\.yaml.*?)```", text, re.S).group(1)


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


def resolved(path) -> dict:
    from launcher.recipe import load

    return leaves(OmegaConf.to_container(load(path).config))


def test_the_readmes_recipe_is_the_shipped_quickstart_in_about_twenty_lines(tmp_path):
    """The README's recipe leaves out the keys at their defaults: it resolves to exactly what the shipped recipe
    resolves to."""
    block = quickstart_block(README)
    assert len(settings(block)) <= 22
    (tmp_path / "readme.yaml").write_text(block)
    assert resolved(tmp_path / "readme.yaml") == resolved(QUICKSTART)


def test_the_recipe_block_is_the_shipped_quickstart_with_every_default(tmp_path):
    """docs/writing-recipes.md's every-key recipe. The rule: (1) the shipped recipe's own lines appear in the
    block, in order, as written (comments and the spacing after a key aside); (2) the block, loaded as a recipe,
    resolves to exactly what the shipped recipe resolves to, so each added line shows the schema's default; (3)
    it names every key of the schema."""
    from launcher.recipe import Recipe, load

    block = quickstart_block(page("writing-recipes.md"))
    shipped = settings(QUICKSTART.read_text())
    shown = settings(block)
    at = 0
    for line in shipped:
        assert line in shown[at:], f"recipes/quickstart.yaml's line {line!r} is not in the block (in order)"
        at = shown.index(line, at) + 1
    (tmp_path / "readme.yaml").write_text(block)
    as_shown = leaves(OmegaConf.to_container(load(tmp_path / "readme.yaml").config))
    expected = leaves(OmegaConf.to_container(load(QUICKSTART).config))
    differ = [f"{k}: the page {as_shown.get(k)!r}, shipped or default {expected.get(k)!r}"
              for k in sorted(as_shown.keys() | expected.keys()) if as_shown.get(k, ...) != expected.get(k, ...)]
    assert not differ, "the every-key recipe block differs from recipes/quickstart.yaml: " + "; ".join(differ)
    missing = [key for key in schema_keys(Recipe) if key not in dotted_keys(yaml.safe_load(block))]
    assert not missing, f"docs/writing-recipes.md's recipe block lacks {missing}"


def test_the_recipe_reference_is_current_and_says_what_each_key_does():
    from launcher.recipe import Recipe
    from launcher.recipe.reference import keys, render

    assert (REPO / "docs" / "recipe.md").read_text() == render(), \
        "docs/recipe.md is stale: python -m launcher.recipe.reference > docs/recipe.md"
    rows = {key: (kind, default, meaning) for key, kind, default, meaning in keys()}
    assert set(schema_keys(Recipe)) <= set(rows)
    assert not [key for key, (_, _, meaning) in rows.items() if len(meaning) < 8], "keys without a meaning"
    assert "docs/recipe.md" in README


def commands(text: str) -> list[list[str]]:
    """Every command of the text's ```bash blocks, in order: continuation lines joined, comments dropped."""
    blocks = re.findall(r"^( *)```bash\n(.*?)^\1```", text, re.S | re.M)
    lines = "\n".join(textwrap.dedent(body) for _, body in blocks).replace("\\\n", " ")
    return [shlex.split(line, comments=True) for line in lines.splitlines() if shlex.split(line, comments=True)]


HERE = ("recipes.components.hf_folder", "launcher.export")  # the walk's commands it runs in its own process


def _in_this_process(module: str, args: list[str], cwd) -> tuple:
    """`python -m MODULE ARGS` from the folder `cwd`, run in this process (torch and transformers imported once):
    its exit code and what it printed."""
    import contextlib
    import io

    out = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        patch.chdir(cwd)
        try:
            code = importlib.import_module(module).main(args)
        except SystemExit as e:
            code = e.code
    return code, out.getvalue()


def _option(argv: list[str], key: str, default: str | None = None) -> str | None:
    found = [a.split("=", 1)[1] for a in argv if a.startswith(key + "=")]
    return found[-1] if found else default


def _moe_line(clone, argv: list[str]) -> str:
    """The line a run of `argv` (python -m launcher RECIPE key=value ...) says of its experts at start: its model
    built from the recipe in the clone's folder, as the run builds it."""
    from launcher.model.moe import described
    from launcher.recipe import instantiate, load

    cwd = os.getcwd()
    os.chdir(clone)  # the recipe names its folder relative to the clone
    try:
        return described(instantiate(load(clone / argv[3], argv[4:]).recipe.model))
    finally:
        os.chdir(cwd)


@pytest.mark.slow
def test_the_fine_tuning_section_walked_in_order_on_a_fresh_clone(tmp_path):
    """A newcomer types docs/fine-tuning.md's commands in order on a CPU: each does what its text says. Before,
    the fsdp command resumed the finished single run and trained nothing, and the export folder was not the one
    the recipe named; the MoE section's first line said the router's loss was trained where its command said it
    was not, and the DPO section had no command to run. Run as written, in a folder standing for a fresh clone (the repo's recipes, no runs/)."""
    import safetensors
    import torch
    import transformers

    text = page("fine-tuning.md")
    (tmp_path / "recipes").symlink_to(REPO / "recipes")
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}  # this checkout's launcher; a CPU
    trained: list[str] = []
    walked = commands(text)
    for argv in walked:
        shown = " ".join(argv)
        if argv[:4] == ["python", "-m", "pip", "install"]:  # not run: it would reinstall this checkout elsewhere
            extra = re.search(r"\.\[(\w+)\]", shown).group(1)
            assert extra in (REPO / "pyproject.toml").read_text() and importlib.util.find_spec(extra), shown
            continue
        if argv[2] in HERE:  # writes or reads files alone: its process is not what the page says
            code, out = _in_this_process(argv[2], argv[3:], tmp_path)
        else:  # trains: a process as typed, on the CPU (CUDA hidden)
            done = subprocess.run([sys.executable, *argv[1:]], cwd=tmp_path, env=env, capture_output=True, text=True,
                                  timeout=paced(300))
            code, out = done.returncode, done.stdout + done.stderr
        assert code == 0, f"{shown}\n{out}"
        if argv[:3] == ["python", "-m", "recipes.components.hf_folder"]:  # writes a folder from_pretrained loads
            model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / argv[3])
            kind = "Qwen3MoeForCausalLM" if "--moe" in argv else "LlamaForCausalLM"  # a mixture of experts' section
            assert type(model).__name__ == kind and f"`{argv[3]}/`" in text
        elif argv[:3] == ["python", "-m", "launcher"]:  # trains a run of its own, from the folder, every step
            recipe = yaml.safe_load((tmp_path / argv[3]).read_text())
            name = _option(argv, "name", recipe["name"])
            steps = recipe["on_cpu"]["trainer"]["max_steps"]
            assert "resumed" not in out and "nothing to train" not in out, f"{shown}\n{out}"
            assert f"training {name}: {steps} steps" in out and f"step {steps}/{steps}" in out, f"{shown}\n{out}"
            assert name not in trained, f"{shown}: the run folder of an earlier command"
            trained.append(name)
            folder = _option(argv, "model.config.pretrained_model_name_or_path",
                             _option(argv, "model.model.config.pretrained_model_name_or_path"))
            assert f"initialised the model from {folder}" in out, out
            if folder == "runs/tiny-qwen3-moe":  # the lines it shows, and each rank reading its experts
                shown = re.search(r"```\n(moe: .*?)```", text, re.S).group(1).splitlines()
                said = re.search(r"^moe: .*$", out, re.M).group(0)
                assert said == shown[0] and "is not trained" in said, (said, shown)  # the page's first: this command's
                assert _moe_line(tmp_path, [*argv, "model.config.output_router_logits=true"]) == shown[1]  # its second
                assert f"initialised the model from {folder} into this rank's shards" in out, out
            if _option(argv, "strategy") == "fsdp":
                assert f"fsdp: sharded over {_option(argv, 'nproc_per_node')} ranks" in out, out
            assert (tmp_path / "runs" / name / "model.pt").exists()
            if "peft" in str(recipe["model"]["_target_"]):  # "keeps its adapters' config in <run_dir>/..."
                assert "8 adapter tensors as built" in out, out
                assert (tmp_path / "runs" / name / "adapter_config.json").exists()
            else:
                assert f"`runs/{name}/`" in text, f"{shown}: the text does not say where it trains"
        elif argv[:3] == ["python", "-m", "launcher.export"]:  # the run as an HF folder from_pretrained loads
            run, out_dir = tmp_path / argv[3], tmp_path / argv[4]
            assert f"`{argv[4]}/`" in text
            model, info = transformers.AutoModelForCausalLM.from_pretrained(out_dir, output_loading_info=True)
            assert not any(info.values()), info
            with safetensors.safe_open(out_dir / "model.safetensors", "pt") as f:
                names, dtypes = set(f.keys()), {f.get_slice(k).get_dtype() for k in f.keys()}
            if argv[3] == "runs/moe":  # as the folder it came from: each expert's own matrices
                assert "model.layers.0.mlp.experts.7.gate_proj.weight" in names and dtypes == {"F32"}, names
            else:
                assert f"from_pretrained(\"{argv[4]}\")" in text
                assert f"{argv[4]} --format hf --dtype bf16" in (REPO / "recipes" / "hf_finetune.yaml").read_text()
                assert dtypes == {"BF16"}
            trained_weights = torch.load(run / "model.pt", weights_only=True)
            for key, value in model.state_dict().items():
                if key in trained_weights:
                    torch.testing.assert_close(value, trained_weights[key].to(value.dtype), rtol=0, atol=0)
        else:
            pytest.fail(f"{shown}: a command of the page this test does not check; say here what it does")
    assert [a[:4] for a in walked[:4]] == [["python", "-m", "recipes.components.hf_folder", "runs/tiny-llama"],
                                            ["python", "-m", "launcher", "recipes/hf_finetune.yaml"],
                                            ["python", "-m", "launcher", "recipes/hf_finetune.yaml"],
                                            ["python", "-m", "launcher.export", "runs/hf_finetune"]]
    assert trained == ["hf_finetune", "hf_finetune-fsdp", "hf_lora", "moe", "hf_dpo"], trained


def test_the_text_data_sections_lines_at_start_are_those_its_command_gives(tmp_path, monkeypatch):
    """docs/text-data.md's commands are the tiny folder and, after it, a run on it: recipes/hf_sft.yaml (the first
    section), recipes/hf_dpo.yaml on the clone's pairs (Preference pairs) and hf_sft.yaml's data made a mixture
    of the clone's files (Mixing sources by weight). The lines each section shows are what its command's
    data.train says, built in a folder standing for a fresh clone (only its tokenizer written). Before, the
    preference and mixing sections had no command, and the mixture named files a clone lacks."""
    from launcher.data.text import cache as token_cache
    from launcher.recipe import instantiate, load
    from recipes.components.tiny_tokenizer import bpe

    text = page("text-data.md")
    folder = ["python", "-m", "recipes.components.hf_folder", "runs/tiny-llama"]
    walked = commands(text)
    assert walked[0::2] == [folder] * 3, walked
    sft, dpo, mix = walked[1::2]
    on_tiny = ["model.config.pretrained_model_name_or_path=runs/tiny-llama"]
    assert sft == ["python", "-m", "launcher", "recipes/hf_sft.yaml", *on_tiny]
    assert dpo == ["python", "-m", "launcher", "recipes/hf_dpo.yaml", *on_tiny, "data.train.max_len=48"]
    assert mix[:6] == ["python", "-m", "launcher", "recipes/hf_sft.yaml", *on_tiny, "name=hf_mix"]
    (tmp_path / "recipes").symlink_to(REPO / "recipes")
    bpe().save_pretrained(tmp_path / "runs" / "tiny-llama")  # the folder's tokenizer, as hf_folder writes it
    monkeypatch.chdir(tmp_path)

    def said(argv: list[str]) -> list[str]:
        data = instantiate(load(tmp_path / argv[3], argv[4:]).recipe.data.train)
        return [f"data.train: {line}" for line in data.notes]

    def shown_after(marker: str) -> list[str]:
        return re.search(re.escape(marker) + r".*?```\n(data\.train: .*?)```", text, re.S).group(1).splitlines()

    shown, first = re.search(r"```\n(data\.train: .*?)```", text, re.S).group(1).splitlines(), said(sft)
    assert first[:-1] == shown[:-1]
    # the last names the entry in the default folder (~/.cache/launcher/text), here the test's own
    # ($LAUNCHER_CACHE/text: conftest.py keeps the user's folder out of the tests)
    entry = re.escape(shown[-1].replace("/home/you/.cache/launcher/text", str(token_cache.folder(True)))).replace(
        re.escape("<32 hex digits>"), "[0-9a-f]{32}")
    assert re.fullmatch(entry, first[-1]), first[-1]
    pairs = said(dpo)
    assert all(line in pairs for line in shown_after("## Preference pairs")), pairs
    mixed = said(mix)
    assert all(line in mixed for line in shown_after("- **The lines at start**")), mixed
    assert "`runs/hf_mix/`" in text


def ways_of_launching() -> list[list[str]]:
    """The commands of the README's "Ways of launching" table, row by row."""
    section = README.split("## Ways of launching", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[2] for line in section.splitlines() if line.startswith("| ") and "`" in line]
    return [shlex.split(re.search(r"`([^`]+)`", row).group(1)) for row in rows]


def _port() -> str:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


@pytest.mark.slow
def test_the_ways_of_launching_walked_in_order_after_the_quickstart(tmp_path):
    """The README's quickstart, then each row of "Ways of launching" in order, as a newcomer types them on a CPU
    in a fresh clone: each does what its row says. Before, the torchrun and accelerate rows resumed the
    quickstart's finished run and trained nothing, and the accelerate row started one process, silently. Real
    torchrun and accelerate launch (their modules, given a free port), 8 steps each; the Slurm row rendered, not
    submitted (no cluster here: its job would train the folder the script names, which must not hold a run)."""
    import shutil
    import time

    quickstart = shlex.split(re.search(r"&& (python -m launcher recipes/quickstart\.yaml)\n", README).group(1))
    rows = ways_of_launching()
    assert [r[:2] for r in rows] == [["python", "-m"], ["torchrun", "--nproc_per_node=4"], ["accelerate", "launch"],
                                     ["python", "-m"], ["python", "-m"]], rows
    (tmp_path / "recipes").symlink_to(REPO / "recipes")
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}  # this checkout's launcher; a CPU
    short = ["trainer.max_steps=8", "logging.memory_plan=false"]  # 8 steps, and no planner process beside each
    pace = None

    def typed(argv: list[str], expect: int = 0) -> str:
        nonlocal pace
        real = {"python": [sys.executable],
                "torchrun": [sys.executable, "-m", "torch.distributed.run", f"--master_port={_port()}"],
                "accelerate": [sys.executable, "-m", "accelerate.commands.launch", f"--main_process_port={_port()}"]}
        command = real[argv[0]] + argv[1 + (argv[0] == "accelerate"):]
        started = time.monotonic()
        done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=None if pace is None else 40 * pace)  # 40 times the quickstart's own pace
        pace = pace or time.monotonic() - started
        out = done.stdout + done.stderr
        assert done.returncode == expect, f"{' '.join(argv)}\n{out[-4000:]}"
        return out

    def trained(out: str, name: str, ranks: int, strategy: str) -> None:
        assert f"training {name}: 8 steps" in out and f"on cpu ({strategy})" in out and "step 8/8" in out, out
        assert "resumed" not in out and "nothing to train" not in out, out
        assert len(re.findall(r"^\d+ +\d+ +0 +cpu", out, re.M)) == ranks, out  # rank 0's table: a line per rank
        assert (tmp_path / "runs" / name / "model.pt").exists()

    trained(typed([*quickstart, *short]), "quickstart", 1, "single")
    one, torchrun, accelerate, slurm, sweep = rows
    assert one == quickstart  # the quickstart again: finished, it says so and how to start afresh
    again = typed([*one, *short])
    assert "runs/quickstart already finished at step 8; nothing to train (name=NEW trains a run of its own, " \
           "checkpoint.resume=never trains this one anew)" in again, again
    trained(typed([*torchrun, *short]), "quickstart-ddp", 4, "ddp")
    trained(typed([*accelerate, *short]), "quickstart-accelerate", 2, "accelerate")
    assert slurm[3] == "submit"
    script = typed([*slurm[:3], "render", *slurm[4:], *short])
    name = _option(slurm, "name")
    assert f"run_dir={tmp_path / 'runs' / name}" in script and "#SBATCH --nodes=2" in script, script
    assert not (tmp_path / "runs" / name).exists()  # the job trains a run of its own from step 0
    if shutil.which("sbatch", path=env["PATH"]) is None:  # as typed: one line says what is missing
        said = typed([*slurm, *short], expect=2)
        assert "launcher: sbatch is not on PATH" in said, said
    table = typed([*(a if a != "trainer.max_steps=200" else short[0] for a in sweep), short[1]])
    assert len(re.findall(r"\bdone +8/8\b", table)) == 4, table
    assert len(list((tmp_path / "runs" / "quickstart").glob("lr=*/model.pt"))) == 4
