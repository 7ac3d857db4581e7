"""python -m launcher.plan: a recipe's peak memory per rank under each layout, found on fake tensors; and every
run's measured peak beside the planned one."""

import json
import os
import shlex
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.pace import paced

QUICK = ["recipes/quickstart.yaml"]


def plan(*args, check=True):
    """python -m launcher.plan --jobs 1 ARGS run in this process (torch imported once; the accuracy test below
    runs the command itself, beside its runs): its exit code, stdout and stderr."""
    done = in_this_process(["--jobs", "1", *args])
    if check:
        assert done.returncode == 0, done.stderr[-3000:]
    return done


def in_this_process(argv) -> subprocess.CompletedProcess:
    import contextlib
    import io

    from launcher.plan.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as e:  # argparse's mistakes: the exit code python -m launcher.plan ends with
            code = e.code
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def planned_here(argv, out) -> int:
    """The peak python -m launcher.plan --as-run plans with `argv` (as a run starts it), planned in this
    process: what it writes to its --out file, as the run reads it."""
    done = in_this_process([*argv, "--out", out])
    assert done.returncode == 0, (argv, done.stderr[-3000:])
    return json.loads(out.read_text().splitlines()[0])["peak_bytes"]


def linear(tmp_path, target: str, returned: str):
    """The quickstart recipe, written in tmp_path with its model `target` (module.Class, a Linear(32, 10) whose
    forward returns `returned`, of its output y; the module beside the recipe, whose folder is importable)."""
    module, name = target.split(".")
    (tmp_path / f"{module}.py").write_text(
        "import torch\n"
        f"class {name}(torch.nn.Linear):\n"
        "    def forward(self, x):\n"
        "        y = super().forward(x)\n"
        f"        return {returned}\n")
    recipe = tmp_path / "r.yaml"
    recipe.write_text((REPO / "recipes/quickstart.yaml").read_text().replace(
        "model: {_target_: recipes.components.mlp.MLP, in_dim: 32, hidden: 128, classes: 10}",
        f"model: {{_target_: {target}, in_features: 32, out_features: 10}}"))
    return recipe


def rows(*args):
    return {r["layout"]: r for r in map(json.loads, plan(*args, "--json").stdout.splitlines())}


@pytest.mark.slow  # a longer run: left out of the fast tier (-m "not slow")
def test_the_table_says_what_fits_the_largest_micro_batch_and_the_layout_to_use():
    found = rows(*QUICK, "--devices", "4", "--memory", "400KiB", "--device", "cpu")
    assert list(found) == ["ddp x4", "fsdp x4", "fsdp x4 +ac", "hsdp 2x2", "fsdp x2 tp x2", "tp x4"]
    # the MLP has no repeated blocks to recompute and no tensor-parallel plan: one line each, not a traceback
    assert "no repeated blocks" in found["fsdp x4 +ac"]["problem"]
    assert "tp_plan" in found["tp x4"]["problem"]
    ddp, fsdp, hsdp = found["ddp x4"], found["fsdp x4"], found["hsdp 2x2"]
    assert ddp["micro_batch"] == fsdp["micro_batch"] == 16  # data.batch_size 64 over 4 data-parallel ranks
    kinds = {k: v for k, v in ddp["by_kind"].items()}
    assert sum(kinds.values()) == ddp["peak_bytes"]
    # the MLP's 22,026 fp32 parameters: whole on a ddp rank, a quarter on an fsdp rank, a half under hsdp 2x2
    assert kinds["parameters"] == 4 * 22026
    assert 22026 <= fsdp["by_kind"]["parameters"] < 22026 * 1.02  # (shards padded to a multiple of the world)
    assert 2 * 22026 <= hsdp["by_kind"]["parameters"] < 2 * 22026 * 1.02
    # AdamW: two moments per parameter, and a step count per tensor
    assert 0 < fsdp["by_kind"]["optimizer"] - 2 * fsdp["by_kind"]["parameters"] <= 6 * 8
    assert ddp["fits"] is False and fsdp["fits"] is True  # 400 KiB: ddp's 438 KiB does not, fsdp's 266 KiB does
    assert ddp["largest_micro_batch"] < 16 < fsdp["largest_micro_batch"]
    shown = plan(*QUICK, "--devices", "4", "--memory", "400KiB", "--device", "cpu").stdout
    assert "use: hsdp 2x2 (the least communication that fits)" in shown
    assert shown.rstrip().endswith("python -m launcher recipes/quickstart.yaml strategy=fsdp nproc_per_node=4 "
                                   "parallel.dp_replicate=2")
    assert "cannot: trainer.activation_checkpointing: auto finds no repeated blocks" in shown


@pytest.mark.slow  # a longer run: left out of the fast tier (-m "not slow")
def test_activation_checkpointing_and_more_devices_lower_the_peak():
    small = ["model.n_layer=2"]
    found = rows("recipes/charlm.yaml", "--devices", "4", "--memory", "1GB", "--device", "cpu", *small)
    plain, recomputed = found["fsdp x4"]["by_kind"], found["fsdp x4 +ac"]["by_kind"]
    assert recomputed["activations"] < plain["activations"] / 4
    two = rows("recipes/charlm.yaml", "--devices", "2", "--device", "cpu", *small)["fsdp x2"]
    assert found["fsdp x4"]["peak_bytes"] < two["peak_bytes"]
    assert found["fsdp x2 tp x2"]["problem"] is None and found["tp x4"]["problem"] is None  # charlm's recipe gives a plan
    none = plan("recipes/charlm.yaml", "--devices", "2", "--memory", "1MB", *small).stdout
    assert "none fits in 976.6 KiB per device" in none


@pytest.mark.slow  # a longer run: left out of the fast tier (-m "not slow")
def test_mistakes_are_one_line():
    for args, said in ((["--memory", "lots"], "--memory lots: give one device's memory, such as 80GB"),
                       (["--devices", "0"], "--devices 0: give a number of devices of 1 or more"),
                       (["--length", "8"], "--length 8: give a length of 1 or more, with --as-run (a run's batch)"),
                       (["--as-run", "single", "--length", "0"], "--length 0: give a length of 1 or more"),
                       (["data.batch_size=-1"], "data.batch_size")):
        done = plan(*QUICK, *args, check=False)
        assert done.returncode == 2, done.stderr
        assert said in done.stderr and "Traceback" not in done.stderr
    done = plan(*QUICK, "--devices", "3", "--json")
    assert "does not divide among its 3 data-parallel ranks" in json.loads(done.stdout.splitlines()[0])["problem"]


@pytest.mark.slow  # a longer run: left out of the fast tier (-m "not slow")
def test_a_step_fake_tensors_cannot_run_is_one_line_naming_the_operation(tmp_path):
    recipe = linear(tmp_path, "reads.Reads", "y * float(y.abs().max())  # the host reads a value made from the weights")
    done = plan(str(recipe), check=False)
    assert done.returncode == 2
    assert "model: reads.Reads: its training step cannot run on fake tensors (DataDependentOutputException: " \
           "aten._local_scalar_dense.default)" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.slow  # a longer run: left out of the fast tier (-m "not slow")
def test_a_fake_kernel_that_fails_is_one_line_without_torchs_traceback(tmp_path):
    # a grouped product of batches in fp32: a kernel whose fake takes bf16 alone
    recipe = linear(tmp_path, "grouped.Grouped", "torch._grouped_mm(y[None], y[None].transpose(1, 2))[0].sum(-1)")
    done = subprocess.run([sys.executable, "-m", "launcher.plan", str(recipe), "--jobs", "1"], cwd=REPO,
                          capture_output=True, text=True, timeout=paced(300),
                          env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"})
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "launcher: model: grouped.Grouped: its training step cannot run on fake tensors (RuntimeError: Expected "
        "inputs of BF16 type but got mat_a.dtype=torch.float32 and mat_b.dtype=torch.float32.); the plan needs every "
        "operation of the step to have a meta kernel and no step to read the values of a tensor made from the "
        "model's on the host"], done.stderr[-3000:]

# The accuracy table of the README ("Planning memory"): each model under each layout, a real run's peak (torch's
# tracker on the CPU) against the plan the run made of itself. GPT-2 (HF) carries no tensor-parallel plan.
ROWS = ["data.train={_target_: recipes.components.passages.Passages, min_len: 64, max_len: 64, n: 256}"]
MODELS = {
    "mlp": ["recipes/quickstart.yaml", "parallel.tp_plan={'0':colwise,'2':rowwise}", "data.val=null"],
    "charlm": ["recipes/charlm.yaml", "data.val=null", "trainer.eval_every=null"],
    # rows of one length: where they differ, so does each step's peak (the plan's is the longest rows')
    "llama": ["tests/hf_zoo.yaml", "model._target_=tests.hf_zoo.llama", *ROWS],
    "gpt2": ["tests/hf_zoo.yaml", "model._target_=tests.hf_zoo.gpt2", *ROWS],
}
LAYOUTS = {"single": ["strategy=single"], "ddp x2": ["strategy=ddp"], "fsdp x2": ["strategy=fsdp"],
           "tp x2": ["strategy=fsdp", "parallel.tp=2"]}


# One run of each launch planned as every run is, the planner in a process of its own beside training; the others'
# plans made here, by the same planner on the arguments the run gives it (tests/plan_runs.py).
APART = {"charlm single", "llama fsdp x2"}


@pytest.mark.slow
def test_every_run_says_its_measured_peak_beside_the_plan_within_ten_percent(tmp_path):
    from tests.plan_runs import logged, planned_runs

    def cases(layouts):
        return {f"{model} {layout}": [*MODELS[model], *LAYOUTS[layout], f"run_dir={tmp_path / model / layout}",
                                      "trainer.max_steps=3", "trainer.log_every=3", "checkpoint.every=null", "logging.memory_plan=wait",
                                      "logging.jsonl=true", "logging.tensorboard=false", "logging.progress_bar=false"]
                for model in MODELS for layout in layouts if not (model == "gpt2" and layout == "tp x2")}

    ranks, asked = planned_runs(cases(["single"]), APART, tmp_path, nproc=1, timeout=600)
    one = ranks[0]
    ranks, more = planned_runs(cases(["ddp x2", "fsdp x2", "tp x2"]), APART, tmp_path, nproc=2, timeout=900)
    two = ranks[0]
    asked.update(more)
    table = []
    for name, result in {**one, **two}.items():
        assert result["error"] is None, (name, result)
        model, layout = name.split(" ", 1)
        values = logged(tmp_path / model / layout)
        measured = values["memory/peak_bytes"]
        here = planned_here(asked[name]["argv"], tmp_path / f"{name}.json")
        said = [line for line in result["said"].splitlines() if line.startswith("memory: ")]
        assert asked[name]["apart"] == (name in APART)
        if name in APART:  # the run's own planner process: said beside the measured peak, the figure planned here
            planned = values["memory/predicted_peak_bytes"]
            assert said and f"planned {planned / 2**20:.1f} MiB (python -m launcher.plan)" in said[-1], \
                (name, result["said"][-2000:])
            assert planned == here, (name, planned, here)
        else:
            assert "memory/predicted_peak_bytes" not in values and said, (name, result["said"][-2000:])
            planned = here
        off = (planned - measured) / measured
        table.append(f"{model:7} {layout:8} measured {measured / 2**20:8.2f} MiB  planned {planned / 2**20:8.2f} MiB "
                     f"{100 * off:+6.1f}%")
    print("\n".join(table))
    assert len(table) == 15 and len(asked) == 15
    assert all(abs(float(row.split()[-1].rstrip("%"))) <= 10 for row in table), "\n".join(table)


@pytest.mark.slow  # a longer run: left out of the fast tier (-m "not slow")
def test_slurm_renders_the_job_of_the_layout_to_use(capfd):
    capfd.readouterr()
    done = plan(*QUICK, "--devices", "4", "--gpus-per-node", "2", "--memory", "400KiB", "--device", "cpu", "--slurm")
    rendered = done.stdout + capfd.readouterr().out  # (python -m launcher.slurm render, a process of its own)
    assert "#SBATCH --nodes=2" in rendered and "#SBATCH --gpus-per-node=2" in rendered
    assert "--nproc_per_node=2" in rendered
    assert "recipes/quickstart.yaml strategy=fsdp parallel.dp_replicate=2 " in rendered  # hsdp 2x2: one shard group a node
    assert "hsdp 2x2 fits in 400KiB per device" in done.stderr
    refused = plan(*QUICK, "--devices", "4", "--memory", "1KB", "--slurm", check=False)
    assert refused.returncode == 2 and "--slurm: no layout fits in 1KB per device on 4 devices" in refused.stderr


@pytest.mark.slow  # a longer run: left out of the fast tier (-m "not slow")
def test_a_sweep_leaves_out_the_runs_that_will_not_fit_before_starting_any(tmp_path, capsys):
    from launcher.sweep.__main__ import main  # python -m launcher.sweep, in this process (tests/test_sweep.py too)

    code = main([*QUICK, "data.batch_size=64,65536", "data.train.n=70000", f"run_dir={tmp_path}", "--memory", "20MB",
                 "--dry-run"])
    done = capsys.readouterr()
    assert code == 0, done.err
    assert ("sweep: left out batch_size=65536 (data.batch_size=65536): planned 0.14 GiB per rank under single, more "
            "than --memory 20MB") in done.err
    assert "sweep: 1 runs" in done.out and "data.batch_size=64 " in done.out
    code = main([*QUICK, "data.batch_size=64,128", "--memory", "1KB", "--dry-run"])
    assert code == 2 and "--memory 1KB: none of the 2 runs fits on 1 device(s)" in capsys.readouterr().err


@pytest.mark.slow  # a longer run: left out of the fast tier (-m "not slow")
def test_a_deep_stack_planned_from_two_shallow_depths_is_the_stack_planned_whole():
    """A model of more than SHALLOW[1] + 2 identical blocks is planned with its stack cut to the SHALLOW depths,
    each kind of bytes extrapolated to its depth: for an HF Llama of 9 layers, the same peak as planned whole."""
    from launcher.plan import peaks, planner
    from launcher.plan.layouts import Layout
    from launcher.recipe import load

    tiny = ["model.config.hidden_size=64", "model.config.intermediate_size=128", "model.config.num_attention_heads=4",
            "model.config.num_key_value_heads=2", "model.config.num_hidden_layers=9", "model.config.vocab_size=256",
            "data.train.min_len=64", "data.train.max_len=64", "data.batch_size=4", "precision=fp32",
            "trainer.grad_accum_steps=2"]
    recipe = load(REPO / "recipes" / "llama8b.yaml", tiny).recipe
    batches = planner.Batches(recipe)
    assert peaks.depth(recipe) == 9 > peaks.SHALLOW[1] + 2
    for layout in (Layout("ddp", 2), Layout("fsdp", 4, tp=2, recompute=True)):  # fsdp x2 tp x2 +ac
        batch = [batches.of(4 // layout.replicas)]
        whole = peaks.peaks(recipe, layout, batch, "cpu", shallow=None)[0]
        cut = peaks.peaks(recipe, layout, batch, "cpu")[0]
        assert abs(cut.total - whole.total) <= 0.01 * whole.total, (layout.name, cut.by_kind, whole.by_kind)
        assert abs(cut.running - whole.running) <= 0.01 * whole.running, layout.name


# Each architecture the tests build, as transformers configures it by default (dropout on where it has one), its
# plan against its own run's measured peak: single process, rows of one length.
ARCHITECTURES = {
    "gpt2": "{_target_: transformers.GPT2LMHeadModel, config: {_target_: transformers.GPT2Config, vocab_size: 256, "
            "n_positions: 128, n_embd: 32, n_layer: 2, n_head: 4}}",
    "bert": "{_target_: transformers.BertForMaskedLM, config: {_target_: transformers.BertConfig, vocab_size: 256, "
            "hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 4, intermediate_size: 64, "
            "max_position_embeddings: 128}}",
    "t5": "{_target_: transformers.T5ForConditionalGeneration, config: {_target_: transformers.T5Config, vocab_size: 256, "
          "d_model: 32, d_kv: 8, d_ff: 64, num_layers: 2, num_heads: 4, decoder_start_token_id: 0, pad_token_id: 0}}",
    "mixtral": "{_target_: transformers.MixtralForCausalLM, config: {_target_: transformers.MixtralConfig, vocab_size: "
               "256, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4, "
               "num_key_value_heads: 2, num_local_experts: 4, num_experts_per_tok: 2, max_position_embeddings: 128}}",
    "qwen2_moe": "{_target_: transformers.Qwen2MoeForCausalLM, config: {_target_: transformers.Qwen2MoeConfig, "
                 "vocab_size: 256, hidden_size: 32, intermediate_size: 64, moe_intermediate_size: 32, "
                 "shared_expert_intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4, "
                 "num_key_value_heads: 2, num_experts: 4, num_experts_per_tok: 2, max_position_embeddings: 128}}",
}


@pytest.mark.slow
def test_each_architecture_is_planned_within_ten_percent_of_its_runs_peak(tmp_path):
    """Dropout (the CPU's attention takes its math path then), a batch with no padding (no mask made), experts'
    grouped products in fp32, a ViT built by an initialisation fake tensors cannot run: each planned as run."""
    from tests.plan_runs import logged, planned_runs

    short = ["trainer.max_steps=3", "trainer.log_every=3", "checkpoint.every=null", "logging.memory_plan=wait",
             "logging.jsonl=true"]
    cases = {name: ["tests/hf_zoo.yaml", f"model={model}", *ROWS, *short, f"run_dir={tmp_path / name}"]
             for name, model in ARCHITECTURES.items()}
    cases["vit"] = ["tests/hf_zoo.yaml", "model._target_=tests.hf_zoo.vit", "data.train._target_=tests.hf_zoo.Images",
                    "data.collate=null", *short, f"run_dir={tmp_path / 'vit'}"]
    ranks, asked = planned_runs(cases, set(), tmp_path, nproc=1, timeout=900)
    table = []
    for name, result in ranks[0].items():
        assert result["error"] is None, (name, result)
        values = logged(tmp_path / name)
        measured, planned = values["memory/peak_bytes"], planned_here(asked[name]["argv"], tmp_path / f"{name}.json")
        table.append((name, measured, planned, 100 * (planned - measured) / measured))
    print("\n".join(f"{n:10} measured {m / 2**20:7.2f} MiB  planned {p / 2**20:7.2f} MiB {off:+6.1f}%"
                    for n, m, p, off in table))
    assert len(table) == 6 and all(abs(off) <= 10 for *_, off in table), table


@pytest.mark.slow
def test_a_layout_the_step_fails_under_is_a_row_and_the_rest_of_the_plan_stands():
    """T5's blocks cannot recompute (a run fails alike): the +ac row says so; the one process is planned; the two
    rows of one device have names of their own."""
    found = rows("tests/hf_zoo.yaml", "model._target_=tests.hf_zoo.t5", "--device", "cpu")
    assert list(found) == ["single", "single +ac"]
    assert found["single"]["peak_bytes"] > 0 and found["single"]["problem"] is None
    assert found["single +ac"]["problem"].startswith("its blocks cannot recompute their activations (CheckpointError")


@pytest.mark.slow
def test_the_ddp_row_of_a_vit_and_of_a_lora_recipe_is_planned(tmp_path):
    from recipes.components.hf_folder import write

    vit = rows("tests/hf_zoo.yaml", "model._target_=tests.hf_zoo.vit", "data.train._target_=tests.hf_zoo.Images",
               "data.collate=null", "--devices", "2", "--device", "cpu")
    assert vit["ddp x2"]["problem"] is None and vit["ddp x2"]["peak_bytes"] > 0
    write(str(tmp_path / "base"))
    lora = ["recipes/hf_lora.yaml", f"model.model.config.pretrained_model_name_or_path={tmp_path / 'base'}",
            "on_cpu=null", "precision=fp32", "--devices", "2", "--device", "cpu", "--memory", "1GB"]
    assert rows(*lora)["ddp x2"]["problem"] is None
    assert "use: ddp x2 (the least communication that fits)" in plan(*lora).stdout


@pytest.mark.slow
def test_a_batch_no_layout_divides_is_said_as_such():
    shown = plan(*QUICK, "--devices", "3", "--memory", "1GB").stdout
    assert "none fits" not in shown
    assert shown.rstrip().splitlines()[-1] == ("none planned: data.batch_size 64 does not divide among the "
                                               "data-parallel ranks of any layout on 3 devices; plan for a number of "
                                               "devices that divides it, or give data.batch_size a multiple of 3")


PRINTS = ("import torch\n"
          "from recipes.components.mlp import MLP\n"
          "class Prints(MLP):  # as nanoGPT's model.py, which says its size when built\n"
          "    def __init__(self, **kwargs):\n"
          "        super().__init__(**kwargs)\n"
          "        print(f'number of parameters: {sum(p.numel() for p in self.parameters()) / 1e6:.2f}M')\n")


def launch(tmp_path, *overrides):
    """python -m launcher on the quickstart recipe (its model printing when built), 3 steps: what it said."""
    (tmp_path / "prints.py").write_text(PRINTS)
    done = subprocess.run([sys.executable, "-m", "launcher", *QUICK, "model._target_=prints.Prints",
                           "trainer.max_steps=3", "trainer.log_every=3", "logging.tensorboard=false",
                           "logging.progress_bar=false", f"run_dir={tmp_path / 'run'}", *overrides], cwd=REPO,
                          capture_output=True, text=True, timeout=paced(600),
                          env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_a_model_that_prints_when_built_leaves_the_plan_beside_its_run_readable(tmp_path):
    said = launch(tmp_path, "logging.memory_plan=wait")
    assert "number of parameters: 0.02M" in said
    assert "planned 0.4 MiB (python -m launcher.plan), +0.0%" in said


@pytest.mark.slow
def test_a_run_too_short_for_its_plan_ends_on_its_result(tmp_path):
    said = launch(tmp_path).rstrip().splitlines()
    assert said[-1].startswith("done: step 3")
    assert said[-2].startswith("memory: 0.4 MiB per rank at the peak (torch's memory tracker, step 2); which layouts "
                               "fit N devices of a size, and their largest micro-batch: python -m launcher.plan "), said
    # what to do with the figure: the command that sizes devices for this recipe, which runs as said
    command = shlex.split(said[-2].split("micro-batch: ", 1)[1])
    assert command[-4:] == ["--devices", "N", "--memory", "80GB"] and "model._target_=prints.Prints" in command, command
    done = subprocess.run([sys.executable, *command[1:-4], "--devices", "1", "--memory", "80GB", "--jobs", "1"],
                          cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"})
    assert done.returncode == 0 and "use:" in done.stdout.lower(), done.stdout + done.stderr


def test_the_planner_beside_a_run_starts_when_asked_and_takes_no_core_the_run_needs(tmp_path):
    from launcher.observe import memory

    planned = memory.Planned(tmp_path / "r.yaml", [], "single", 1, "cpu")
    try:
        assert planned.process is None and not planned.ready()  # not while the run starts
        planned.argv = [sys.executable, "-c", "import time; time.sleep(30)"]
        planned.start()
        assert os.sched_getscheduler(planned.process.pid) == os.SCHED_IDLE  # the CPU when nothing else wants it
    finally:
        planned.close()


def test_whatever_the_planner_leaves_its_result_is_a_line_and_never_an_error(tmp_path):
    from launcher.observe import memory

    for left in ("number of parameters: 0.02M\n{}", "", '{"peak_bytes": "many"}', "[1, 2]"):
        planned = memory.Planned(tmp_path / "r.yaml", [], "single", 1, "cpu")
        planned.argv = [sys.executable, "-c", f"open({str(planned.out)!r}, 'w').write({left!r})"]
        try:
            figure, line = planned.result(wait=True)
        finally:
            planned.close()
        assert figure is None and line.startswith("memory: not planned: "), (left, line)
    planned = memory.Planned(tmp_path / "r.yaml", [], "single", 1, "cpu")
    planned.argv = [str(tmp_path / "no-such-python")]
    planned.start()  # no exception: a line
    assert planned.ready() and planned.result(wait=False)[1].startswith("memory: not planned: the planner could not start")
    planned.close()


def test_the_planner_s_failure_names_the_command_that_plans_as_the_run_did(tmp_path):
    """The line says the command that shows the planner's failure: its arguments are the run's own, the device type
    included (the CPU's plan is not the default CUDA's: where gradients are freed, which attention stands in)."""
    import shlex

    from launcher.observe import memory

    planned = memory.Planned(tmp_path / "r.yaml", ["trainer.max_steps=3"], "ddp", 2, "cpu")
    planned.argv = [sys.executable, "-c", "import sys; sys.exit('launcher: it failed')"]
    try:
        figure, line = planned.result(wait=True)
    finally:
        planned.close()
    assert figure is None and line == (f"memory: not planned: the planner failed (it failed; python -m launcher.plan "
                                       f"{shlex.quote(str(tmp_path / 'r.yaml'))} trainer.max_steps=3 --as-run ddp "
                                       f"--devices 2 --device cpu shows it)")


def test_an_out_file_that_cannot_be_written_is_one_line(tmp_path):
    """--out naming a missing folder, or a folder: one line naming it, exit 2, no traceback (the plan itself made)."""
    for out, why in ((tmp_path / "no-such-folder" / "plan.json", "No such file or directory"),
                     (tmp_path, "Is a directory")):
        done = plan(*QUICK, "--as-run", "single", "--device", "cpu", "--out", out, check=False)
        assert done.returncode == 2, done.stderr
        assert done.stderr == f"launcher: --out {out}: cannot be written ({why}); name a file in a writable folder\n"
