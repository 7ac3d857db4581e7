"""Expert parallelism (parallel.ep, launcher/parallel/experts.py) over real torchrun processes (gloo on the CPU): a
tiny HF Qwen3-MoE (tests/moe_models.py: 8 experts, top 2, its routing uneven by construction) trained under ep x 2
and under ep x 2 inside fsdp's dp_shard 4 ends with one process's weights (SGD with momentum, float64, within
rounding: tests/rounding.py); its checkpoints resume under one process, fsdp x 2 and another ep layout, and theirs
under ep; it exports whole for from_pretrained. The experts modules of Qwen3-MoE, Mixtral, gpt-oss and DeepSeek-V3
dispatch exactly (tests/experts_dispatch.py).

The runs that train share a torchrun launch per world size (tests/several_runs.py); one process's train in this
one. The runs that must fail are launched as a user types them."""

import json
import subprocess
import sys

import pytest
import torch
import transformers

from launcher import export
from launcher.errors import UserError
from tests.conftest import REPO, state_dict
from tests.float64 import overrides as float64
from tests.moe_models import routed
from tests.pace import paced
from tests.rounding import assert_within_rounding
from tests.test_parallel import alone, held, ran

MOE = ["tests/hf_zoo.yaml", "devices=cpu", *float64("tests.moe_models.qwen3_moe"),
       "data.train._target_=tests.moe_models.text", "data.batch_size=8",
       "optimizer={_target_: torch.optim.SGD, lr: 0.1, momentum: 0.9}", "checkpoint.every=3"]
EP = ["strategy=fsdp", "parallel.ep=2"]
MORE = ["trainer.grad_accum_steps=2", "trainer.activation_checkpointing=[Qwen3MoeDecoderLayer]",
        "trainer.clip_grad_norm=0.5"]  # accumulation, recomputed blocks, clipping: gradients on two meshes
STEPS = 6  # tests/hf_zoo.yaml's
# packed rows of 20 to 44 token passages, at most 48 a row (28 to 48 long): a batch is padded to its longest row, on
# two ranks each half to its own longest; the expert load leaves the padding out, so it is the same however the
# batch is split
PACKED = ["data.train={_target_: tests.packed_tokens.PackedTokens, n: 40, min_len: 20, max_len: 44, row_len: 48}",
          "data.collate={_target_: launcher.data.collate.Packed}", "logging.jsonl=true", "checkpoint.every=null"]


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    """One process's run, its checkpoint at step 3, and its final weights as an HF folder (pretrained weights)."""
    from launcher.checkpoint import hf
    from tests.moe_models import qwen3_moe

    folder = tmp_path_factory.mktemp("one")
    alone(folder, *MOE)
    hf.write(folder / "hf", state_dict(folder / "model.pt"), hf.config_of(qwen3_moe()), None, 2**30)
    return folder


@pytest.fixture(scope="module")
def two(tmp_path_factory, one):
    """The two-process runs, one after another in one torchrun launch: ep x 2 from scratch (routing reported),
    fsdp x 2, each resuming the other's step 3, ep x 2 resuming one process's, ep x 2 with accumulation and
    recomputation, and ep x 2 from pretrained weights (built on the meta device, each rank reading its slices)."""
    from tests.several_runs import several

    root = tmp_path_factory.mktemp("ep")
    cases = {"ep": [*MOE, *EP, "model.report=true"],
             "fsdp": [*MOE, "strategy=fsdp"],
             "fsdp-from-ep": [*MOE, "strategy=fsdp", f"checkpoint.resume={root / 'ep' / 'checkpoints' / 'step_3'}"],
             "ep-from-fsdp": [*MOE, *EP, f"checkpoint.resume={root / 'fsdp' / 'checkpoints' / 'step_3'}"],
             "ep-from-one": [*MOE, *EP, f"checkpoint.resume={one / 'checkpoints' / 'step_3'}"],
             "ep-more": [*MOE, *EP, *MORE],
             "ep-pretrained": [*MOE, *EP, f"checkpoint.init_from={one / 'hf'}"],
             "ep-packed": [*MOE, *EP, *PACKED], "fsdp-packed": [*MOE, "strategy=fsdp", *PACKED]}
    return root, several({name: [*args, f"run_dir={root / name}"] for name, args in cases.items()}, root, timeout=900)


@pytest.fixture(scope="module")
def four(tmp_path_factory, two):
    """Four processes (dp_shard 4, ep 2: two ep groups, each expert's slice held by two ranks), one launch: from
    scratch (routing reported), resuming ep x 2's step 3, and under HSDP (dp_replicate 2 x dp_shard 2, ep 2)."""
    from tests.several_runs import several

    root = tmp_path_factory.mktemp("ep4")
    cases = {"ep-fsdp": [*MOE, *EP, "model.report=true"],
             "ep-fsdp-from-ep": [*MOE, *EP, f"checkpoint.resume={two[0] / 'ep' / 'checkpoints' / 'step_3'}"],
             "ep-hsdp": [*MOE, *EP, "parallel.dp_replicate=2"]}
    return root, several({name: [*args, f"run_dir={root / name}"] for name, args in cases.items()}, root, nproc=4,
                         timeout=900)


# A recipe's plan for the tiny Qwen3-MoE's attention: what auto takes of its own, less the embedding and the head.
PLAN = ("parallel.tp_plan={'model.layers.*.self_attn.q_proj': colwise, 'model.layers.*.self_attn.k_proj': colwise, "
        "'model.layers.*.self_attn.v_proj': colwise, 'model.layers.*.self_attn.o_proj': rowwise, "
        "'model.layers.*.self_attn.q_norm': heads_norm, 'model.layers.*.self_attn.k_norm': heads_norm}")


@pytest.fixture(scope="module")
def with_tp(tmp_path_factory, one):
    """Four processes, one launch: ep 2 with tp 2 by the model's own plan (routing reported), ep 2 with tp 2 by
    the recipe's plan resuming one process's step 3, and tp 2 over dp_shard 2 without ep (its per-head norms)."""
    from tests.several_runs import several

    root = tmp_path_factory.mktemp("eptp")
    cases = {"ep-tp": [*MOE, *EP, "parallel.tp=2", "model.report=true"],
             "ep-tp-from-one": [*MOE, *EP, "parallel.tp=2", PLAN, f"checkpoint.resume={one / 'checkpoints' / 'step_3'}"],
             "tp": [*MOE, "strategy=fsdp", "parallel.tp=2", PLAN]}
    return root, several({name: [*args, f"run_dir={root / name}"] for name, args in cases.items()}, root, nproc=4,
                         timeout=900)


def received(ranks, name, ep=2, experts=8):
    """Per experts call (in order, every rank's alike): the (token, slot) pairs each rank of ep sends to each, and
    each expert's count summed over the ranks."""
    calls = [routed(results[name]["said"]) for results in ranks]
    assert len({len(c) for c in calls}) == 1 and calls[0], [len(c) for c in calls]
    out = []
    for each in zip(*calls):
        assert len({module for module, _ in each}) == 1
        local = experts // ep
        sends = [[sum(counts[p * local:(p + 1) * local]) for p in range(ep)] for _, counts in each]
        out.append((each[0][0], sends, [sum(c[e] for _, c in each) for e in range(experts)]))
    return out


def assert_routing_uneven(calls, groups):
    """Some call sends one rank of an ep group more pairs than the other, some rank's experts get none from its
    group, and some expert gets none at all (the cases the dispatch must get right)."""
    got = [[sum(sends[r][p] for r in group) for p in range(2)] for _, sends, _ in calls for group in groups]
    assert any(a != b for a, b in got), got
    assert any(0 in g for g in got) and any(0 not in g for g in got), got
    assert any(0 in counts for _, _, counts in calls)
    assert any(sends[r][0] != sends[r][1] for _, sends, _ in calls for r in range(len(sends)))


@pytest.mark.slow
def test_ep_x2_gives_one_process_weights_with_uneven_routing(one, two):
    folder, said = ran(two, "ep")
    assert "fsdp: dp_shard 2 (ep 2) = 2 ranks; sharded over dp_shard, units Qwen3MoeDecoderLayer" in said
    assert ("parallel.ep: 2 experts modules split over 2 ranks, 4 experts on each (model.layers.0.mlp.experts, "
            "model.layers.1.mlp.experts)") in said
    assert_routing_uneven(received(two[1], "ep"), groups=[(0, 1)])
    assert_within_rounding(one / "model.pt", folder / "model.pt", STEPS)
    assert held(said) == held(ran(two, "fsdp")[1])  # at rest, ep holds what fsdp holds (docs/parallelism.md)


@pytest.mark.slow
def test_ep_x2_inside_fsdp_and_hsdp_over_four_processes_gives_one_process_weights(one, four):
    folder, said = ran(four, "ep-fsdp")
    assert "fsdp: dp_shard 4 (ep 2) = 4 ranks" in said
    assert "; each sharded over the 2 ranks of dp_shard that hold them" in said
    assert_routing_uneven(received(four[1], "ep-fsdp"), groups=[(0, 1), (2, 3)])
    assert_within_rounding(one / "model.pt", folder / "model.pt", STEPS)
    folder, said = ran(four, "ep-hsdp")
    assert "dp_replicate 2 x dp_shard 2 (ep 2) = 4 ranks" in said and "; replicated over dp_replicate 2" in said
    assert_within_rounding(one / "model.pt", folder / "model.pt", STEPS)


@pytest.mark.slow
def test_ep_x2_with_tp_x2_gives_one_process_weights_with_uneven_routing(one, with_tp):
    folder, said = ran(with_tp, "ep-tp")
    assert "fsdp: dp_shard 2 (ep 2) x tp 2 = 4 ranks; sharded over dp_shard, units Qwen3MoeDecoderLayer" in said
    # the model's own plan, less its experts' styles: the attention, its per-head norms, the embedding and the head
    assert "parallel.tp: 14 layers split over 2 ranks: lm_head (colwise_rep), model.embed_tokens" in said
    assert ("parallel.ep: 2 experts modules split over 2 ranks, 4 experts on each (model.layers.0.mlp.experts, "
            "model.layers.1.mlp.experts); whole on each of tp's 2 ranks (which route the same tokens)") in said
    calls = received(with_tp[1], "ep-tp")  # ranks (dp_shard, tp): the ep groups are each tp rank's, (0, 2), (1, 3)
    assert_routing_uneven(calls, groups=[(0, 2), (1, 3)])
    assert all(sends[0] == sends[1] and sends[2] == sends[3] for _, sends, _ in calls)  # a tp group routes alike
    assert_within_rounding(one / "model.pt", folder / "model.pt", STEPS)


@pytest.mark.slow
def test_tp_splits_qwen3_s_per_head_norms_and_trains_them_as_one_process(one, with_tp):
    folder, said = ran(with_tp, "tp")
    assert "fsdp: dp_shard 2 x tp 2 = 4 ranks" in said and "parallel.tp: 12 layers split over 2 ranks" in said
    assert_within_rounding(one / "model.pt", folder / "model.pt", STEPS)


@pytest.mark.slow
def test_checkpoints_move_between_ep_with_tp_and_one_process(one, with_tp, tmp_path, capsys):
    resumes_both_ways(one, with_tp, "ep-tp", 4, tmp_path, capsys)


def test_an_moe_model_s_own_tp_plan_leaves_its_experts_out():
    from launcher.parallel import plans
    from tests.moe_models import qwen3_moe
    from tests.moe_zoo import model

    attention = {f"model.layers.*.self_attn.{n}_proj": "colwise" for n in "qkv"}
    assert plans.resolve(qwen3_moe(), "auto") == {
        "lm_head": "colwise_rep", "model.embed_tokens": "embedding_rowwise", **attention,
        "model.layers.*.self_attn.q_norm": "heads_norm", "model.layers.*.self_attn.k_norm": "heads_norm",
        "model.layers.*.self_attn.o_proj": "rowwise"}
    assert plans.resolve(model("mixtral"), "auto") == {
        "lm_head": "colwise_rep", "model.embed_tokens": "embedding_rowwise", **attention,
        "model.layers.*.self_attn.o_proj": "rowwise"}


@pytest.mark.slow
def test_checkpoints_move_between_ep_and_fsdp_and_between_ep_layouts(one, two, four):
    for runs, name, source in ((two, "fsdp-from-ep", "ep"), (two, "ep-from-fsdp", "fsdp"),
                               (four, "ep-fsdp-from-ep", "ep")):
        folder, said = ran(runs, name)
        assert f"resumed from {two[0] / source / 'checkpoints' / 'step_3'} (step 3, epoch 0)" in said, said
        assert_within_rounding(one / "model.pt", folder / "model.pt", STEPS)
    assert "written by 2 processes, resharded to 4" in ran(four, "ep-fsdp-from-ep")[1]


@pytest.mark.slow
def test_one_process_checkpoints_resume_under_ep_and_ep_s_in_one_process(one, two, tmp_path, capsys):
    resumes_both_ways(one, two, "ep", 2, tmp_path, capsys)


def resumes_both_ways(one, runs, layout, processes, tmp_path, capsys):
    """`<layout>-from-one` (one process's step 3 resumed under the layout) and the layout's own step 3 resumed in
    one process both end with one process's weights, each checkpoint resharded as its line says."""
    folder, said = ran(runs, f"{layout}-from-one")
    assert f"written by 1 process, resharded to {processes}" in said
    assert_within_rounding(one / "model.pt", folder / "model.pt", STEPS)
    capsys.readouterr()
    alone(tmp_path, *MOE, f"checkpoint.resume={runs[0] / layout / 'checkpoints' / 'step_3'}")
    assert f"written by {processes} processes, resharded to 1" in capsys.readouterr().out
    assert_within_rounding(one / "model.pt", tmp_path / "model.pt", STEPS)


@pytest.mark.slow
def test_an_ep_checkpoint_exports_whole_experts_for_from_pretrained(two, tmp_path):
    folder, _ = ran(two, "ep")
    out = tmp_path / "hf"
    assert export.main([str(folder / "checkpoints" / "step_6"), str(out), "--format", "hf"]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64)
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape == (8, 32, 32)
    trained, loaded = state_dict(folder / "model.pt"), model.state_dict()
    assert trained.keys() == loaded.keys()
    assert all(torch.equal(trained[k], loaded[k]) for k in trained)


@pytest.mark.slow
def test_ep_with_accumulation_recomputation_and_clipping(two, tmp_path):
    folder, _ = ran(two, "ep-more")
    alone(tmp_path, *MOE, *MORE)
    assert_within_rounding(tmp_path / "model.pt", folder / "model.pt", STEPS)


@pytest.mark.slow
def expert_loads(run_dir) -> list:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k.startswith("moe/")} for row in rows if "train/loss" in row]


@pytest.mark.slow
def test_the_expert_load_of_packed_rows_leaves_their_padding_out_alike_at_one_and_two_processes(two, tmp_path):
    """Packed rows (a 4-D mask, which cannot tell padding from a sample): the load counts the rows' real tokens
    alone, so one process and ep x 2 and fsdp x 2 (each rank padding its half of the batch to its own longest row)
    log the same load (counts of tokens: exact). Counting the padding, they differed (0.3828 against 0.3804)."""
    alone(tmp_path / "one", *MOE, *PACKED)
    one = expert_loads(tmp_path / "one")
    assert len(one) == 2 and all(row.keys() >= {"moe/load_max", "moe/load_min"} for row in one), one
    for name in ("ep-packed", "fsdp-packed"):
        folder, _ = ran(two, name)
        assert expert_loads(folder) == one, (name, expert_loads(folder), one)


def test_the_expert_load_counts_the_real_tokens_the_meter_marks():
    """One forward of a batch whose rows are padded: the counts are those of its real tokens (packed rows'
    document_ids >= 0, or a 2-D attention_mask's ones), however much padding the batch holds."""
    from launcher.model.moe import ExpertLoad
    from launcher.run.metrics import _marks
    from tests.moe_models import qwen3_moe

    model = qwen3_moe().train()
    load = ExpertLoad(model, torch.device("cpu"))
    ids = torch.randint(1, 200, (2, 12))
    documents = torch.tensor([[0] * 5 + [1] * 4 + [-1] * 3, [0] * 12])
    for padding in (0, 7):  # the same rows with 7 more padding positions: the same counts
        batch = {"input_ids": torch.cat([ids, torch.zeros(2, padding, dtype=torch.long)], 1),
                 "document_ids": torch.cat([documents, torch.full((2, padding), -1)], 1)}
        load.tokens(_marks(batch))
        with torch.no_grad():
            model(input_ids=batch["input_ids"])
        counts = load.counts.clone()
        load.reset()
        assert counts.sum(1).tolist() == [2 * 21] * 2, counts  # 21 real tokens, top 2, each layer
        if padding:
            assert torch.equal(counts, before)
        before = counts
    load.tokens(_marks({"input_ids": ids, "attention_mask": (documents >= 0).long()}))
    with torch.no_grad():
        model(input_ids=ids)
    assert load.counts.sum(1).tolist() == [2 * 21] * 2
    load.remove()


def test_pretrained_weights_load_into_ep_slices(one, two, tmp_path):
    folder, said = ran(two, "ep-pretrained")
    assert "initialised the model from" in said and "into this rank's shards" in said
    alone(tmp_path, *MOE, f"checkpoint.init_from={one / 'hf'}")
    assert_within_rounding(tmp_path / "model.pt", folder / "model.pt", STEPS)


@pytest.mark.slow
def test_four_hf_moe_models_experts_dispatch_exactly(tmp_path):
    out = tmp_path / "dispatch.json"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "tests/experts_dispatch.py", str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=paced(300))
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        results = json.loads(out.with_suffix(f".rank{rank}.json").read_text())
        assert len(results) == 10
        for case, found in results.items():
            limit = 1e-5 if "grouped" in case else 1e-14  # float32 through the grouped kernel, else float64
            assert found["output"] <= limit and found["tokens"] <= limit, (rank, case, found)
            assert all(x is not None and x <= limit for x in found["experts"].values()), (rank, case, found)
            # the second rank's experts get no token in the skewed cases: gradients there all the same, zeros
            assert all(found["zeros"].values()) == (rank == 1 and case.endswith("skewed")), (rank, case, found)
    gpt_oss = json.loads(out.with_suffix(".rank0.json").read_text())["gpt_oss"]
    assert sorted(gpt_oss["experts"]) == ["down_proj", "down_proj_bias", "gate_up_proj", "gate_up_proj_bias"]


def test_experts_modules_are_recognised_by_their_interface():
    from launcher.parallel import experts
    from tests.moe_models import qwen3_moe

    model = qwen3_moe()
    assert list(experts.found(model)) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert experts.problems(model, 2) == [] and experts.problems(model, 8) == []
    assert experts.problems(model, 3) == [  # one line for the model (the ep chosen), not one per layer
        "parallel.ep: 2 experts modules (model.layers.0.mlp.experts, ...) hold 8 experts each, which do not split over "
        "ep=3 ranks; use an ep that divides 8: 1, 2, 4, 8"]
    model.model.layers[1].mlp.experts.num_experts = 6  # (its weights' first dimension is not read by problems)
    with torch.no_grad():
        for name, param in model.model.layers[1].mlp.experts.named_parameters(recurse=False):
            param.data = param.data[:6].clone()
    assert experts.problems(model, 4) == [
        "parallel.ep: model.layers.1.mlp.experts holds 6 experts, which do not split over ep=4 ranks; use an ep that "
        "divides every layer's count (6, 8): 1, 2"]
    assert experts.problems(model, 5) == [
        "parallel.ep: 2 experts modules (model.layers.0.mlp.experts, ...) hold 6, 8 experts, which do not split over "
        "ep=5 ranks; use an ep that divides every layer's count (6, 8): 1, 2"]
    dense = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4))
    assert experts.found(dense) == {}
    assert experts.problems(dense, 2)[0].startswith("parallel.ep: the model (LlamaForCausalLM) has no experts module "
                                                    "this launcher can split (an HF mixture of experts' experts")


@pytest.mark.parametrize("args, line", [
    (["strategy=ddp", "parallel.ep=2"], "parallel.ep: lays ranks out on a device mesh under strategy fsdp, and the "
                                        "strategy is 'ddp'; set strategy=fsdp, or parallel.ep=1"),
    (["strategy=fsdp", "parallel.ep=2", "parallel.pp=2"], "parallel.ep: splits experts over data-parallel ranks, and is "
                                                          "not built with pipeline stages (parallel.pp=2); set "
                                                          "parallel.pp=1, or parallel.ep=1"),
    (["strategy=fsdp", "parallel.ep=0"], "parallel.ep: must be 1 or more, got 0"),
], ids=["ddp", "pp", "zero"])
def test_an_ep_the_recipe_cannot_run_is_one_line(args, line):
    from launcher.recipe import load

    with pytest.raises(UserError) as caught:
        load(REPO / "recipes" / "quickstart.yaml", args)
    assert any(line in problem for problem in caught.value.problems), caught.value.problems


@pytest.mark.slow
@pytest.mark.parametrize("args, line", [
    (["recipes/quickstart.yaml", "parallel.ep=2"],
     "parallel.ep: the model (MLP) has no experts module this launcher can split"),
    ([*MOE, "parallel.ep=3"], "parallel.ep: ep=3 does not divide the 2 ranks of dp_shard (world 2); use an ep that "
                              "divides 2"),
], ids=["no-experts", "world"])
def test_experts_the_launcher_cannot_split_are_one_line_on_every_rank(tmp_path, args, line):
    done = subprocess.run([sys.executable, "-m", "launcher", *args, "strategy=fsdp", "nproc_per_node=2",
                           "trainer.max_steps=2", f"run_dir={tmp_path}"], cwd=REPO, capture_output=True, text=True,
                          timeout=paced(120))
    assert done.returncode == 2, done.stderr[-2000:]
    ours = [l for l in done.stderr.splitlines() if "launcher:" in l]
    assert len(ours) == 1 and line in ours[0] and "Traceback" not in done.stderr, done.stderr[-2000:]
