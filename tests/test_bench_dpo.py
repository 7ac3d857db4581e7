"""The DPO row of the benchmark (python -m launcher.bench --dpo): its pairs, TRL's side (launcher/bench/dpo/peer.py)
checked against a DPO step written out here on TRL's own tokens, the launcher's tokens of the pairs against TRL's,
and the row run whole, tiny, with its loss against TRL's asserted within 1% (issue 53). Timings are not asserted:
only that they are plausible measurements."""

import argparse
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from launcher.bench.dpo import row as dpo
from tests.conftest import REPO
from tests.pace import paced
from tests.test_bench import bench, plausible


def test_the_step_count_must_leave_steps_after_the_warm_up():
    parser = argparse.ArgumentParser()
    dpo.dpo_options(parser)
    assert parser.parse_args(["--dpo", "--dpo-steps", "8"]).dpo_steps == 8
    assert parser.parse_args(["--dpo"]).dpo_steps == 300
    for bad in ("4", "0", "-8", "twenty", "20.0"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--dpo-steps", bad])


def test_the_pairs_are_a_function_of_the_seed_with_a_preference_to_learn(tmp_path):
    dpo.write_pairs(tmp_path / "a.jsonl", 50)
    dpo.write_pairs(tmp_path / "b.jsonl", 50)
    dpo.write_pairs(tmp_path / "c.jsonl", 50, seed=1)
    a = (tmp_path / "a.jsonl").read_text()
    assert a == (tmp_path / "b.jsonl").read_text() and a != (tmp_path / "c.jsonl").read_text()
    good, bad = set(dpo.WORDS[0::2]), set(dpo.WORDS[1::2])
    for row in map(json.loads, a.splitlines()):
        assert row["prompt"].endswith("?") and not row["prompt"].endswith(" ?")
        for side, words in (("chosen", good), ("rejected", bad)):
            assert re.fullmatch(r" [a-z]+( [a-z]+)*\.", row[side]), row
            assert set(row[side][1:-1].split()) <= words, row


@pytest.fixture(scope="module")
def folder_and_pairs(tmp_path_factory):
    pytest.importorskip("trl", reason="the trl extra is not installed")
    from recipes.components.hf_folder import write

    where = tmp_path_factory.mktemp("dpo")
    write(str(where / "model"), context=dpo.MAX_LEN)
    dpo.write_pairs(where / "pairs.jsonl", 12 * dpo.BATCH)
    return where / "model", where / "pairs.jsonl"


def test_trl_tokenizes_the_pairs_whole_as_in_parts(folder_and_pairs):
    """What dpo/peer.py says of TRL 1.16 and the row's pairs: BOS, the prompt's own tokens, then each answer's own
    tokens and EOS (TRL's split of the joined text falls where the prompt ends), nothing cut by max_len."""
    from transformers import AutoTokenizer

    from launcher.bench.dpo.peer import pairs, tokenized

    folder, data = folder_and_pairs
    tokenizer = AutoTokenizer.from_pretrained(folder)
    theirs, rows = tokenized(str(folder), str(data), dpo.MAX_LEN), pairs(str(data))
    assert len(theirs) == len(rows)
    for pair, row in zip(theirs, rows):
        prompt = tokenizer(row["prompt"])["input_ids"]
        assert pair["prompt_ids"] == prompt and prompt[0] == tokenizer.bos_token_id
        for side in ("chosen", "rejected"):
            answer = tokenizer(row[side], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            assert pair[f"{side}_ids"] == answer, (row, pair)
            assert len(prompt) + len(answer) < dpo.MAX_LEN


def _logps(model, ids, labels, mask):
    """Each row's summed log-probability of its labelled tokens."""
    logits, targets = model(input_ids=ids, attention_mask=mask).logits[:, :-1], labels[:, 1:]
    token = torch.gather(logits.log_softmax(-1), 2, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (token * (targets != -100)).sum(1)


def _batch(theirs, k):
    """TRL's tokens of batch k: chosen rows, then rejected, padded on the right."""
    rows = [theirs[i] for i in range(k * dpo.BATCH, (k + 1) * dpo.BATCH)]
    seqs = [r["prompt_ids"] + r[f"{side}_ids"] for side in ("chosen", "rejected") for r in rows]
    labels = [[-100] * len(r["prompt_ids"]) + r[f"{side}_ids"] for side in ("chosen", "rejected") for r in rows]
    width = max(map(len, seqs))
    return (torch.tensor([s + [0] * (width - len(s)) for s in seqs]),
            torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels]),
            torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs]))


@pytest.mark.slow
def test_trl_s_side_trains_the_dpo_the_row_says(folder_and_pairs):
    """TRL's losses of steps 1-12 are those of sigmoid DPO at the row's beta, plain SGD at its lr, pairs in file
    order, the reference the starting model's, written out here: the peer's settings do what the row claims."""
    from transformers import AutoModelForCausalLM

    from launcher.bench.dpo.peer import tokenized

    folder, data = folder_and_pairs
    steps = 12
    done = subprocess.run([sys.executable, "-m", "launcher.bench.dpo.peer", str(folder), str(data), str(steps),
                           str(dpo.BATCH), str(dpo.MAX_LEN), str(dpo.BETA), str(dpo.LR)], cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=paced(300))
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads([line for line in done.stdout.splitlines() if line.startswith("BENCH ")][-1][6:])
    assert report["steps"] == steps and report["pairs"] == steps * dpo.BATCH

    theirs = tokenized(str(folder), str(data), dpo.MAX_LEN)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        reference = [_logps(model, *_batch(theirs, k)) for k in range(steps)]
    optimizer = torch.optim.SGD(model.parameters(), lr=dpo.LR)
    for k in range(steps):
        chosen, rejected = _logps(model, *_batch(theirs, k)).chunk(2)
        ref_chosen, ref_rejected = reference[k].chunk(2)
        loss = -F.logsigmoid(dpo.BETA * ((chosen - ref_chosen) - (rejected - ref_rejected))).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        assert report["losses"][str(k + 1)] == pytest.approx(loss.item(), rel=1e-5), k + 1
    assert report["losses"][str(steps)] < 0.95 * math.log(2)  # it learnt: the row's pairs hold a preference


def test_the_loss_gap_is_read_at_step_n_and_at_its_worst():
    ours, theirs = {1: 0.6931, 2: 0.60, 3: 0.50}, {1: 0.6931, 2: 0.66, 3: 0.501}
    at, most = dpo.gaps(ours, theirs, 3)
    assert at == pytest.approx(0.001 / 0.501) and most == pytest.approx(0.06 / 0.66)
    assert dpo.gaps(ours, theirs, 1) == (0.0, 0.0)
    with pytest.raises(SystemExit, match=r"no loss logged at steps \[3\]"):
        dpo.gaps({1: 0.69, 2: 0.6}, theirs, 3)


def _runs(losses, step_s):
    return [{"step_s": step_s, "cpu_s": step_s * 0.9, "losses": losses}]


def test_the_row_says_whether_the_loss_is_within_one_percent():
    facts = {"pairs": 64, "min": 20, "max": 80, "mean": 50.0, "same": "  tokens: the same"}
    trl = {1: 0.6931, 2: 0.6, 3: 0.5}
    within = dpo.report({"ours": _runs({1: 0.6931, 2: 0.61, 3: 0.504}, 0.02), "trl": _runs(trl, 0.04)}, facts, 3, "cmd")
    assert "loss at step 3: |ours - TRL| / TRL 8.00e-03, within 1% (issue 53); the largest over steps 1-3 1.67e-02" \
        in within
    assert "ours / TRL step: 0.500 (0.500-0.500) wall, 0.500 (0.500-0.500) CPU (issue 53 asks <= 0.95)" in within
    assert re.search(r"^ours, recipes/hf_dpo +20\.00ms +\(20\.00-20\.00\) +18\.00ms +0\.504000$", "\n".join(within),
                     re.M), within
    beyond = dpo.report({"ours": _runs({1: 0.6931, 2: 0.6, 3: 0.506}, 0.02), "trl": _runs(trl, 0.04)}, facts, 3, "cmd")
    assert any(line.startswith("loss at step 3: |ours - TRL| / TRL 1.20e-02, NOT within 1%") for line in beyond), beyond
    rounds = dpo.report({"ours": _runs(trl, 0.02) + _runs(trl, 0.03), "trl": _runs(trl, 0.04) * 2}, facts, 3, "cmd")
    assert "ours / TRL step: 0.625 (0.500-0.750) wall, 0.625 (0.500-0.750) CPU (issue 53 asks <= 0.95)" in rounds
    assert rounds[-1].startswith("the rounds' ratios lie apart by (max - min) / median: wall 40%, CPU 40%"), rounds


def test_the_launcher_reads_the_pairs_as_the_same_tokens_as_trl(folder_and_pairs):
    """The launcher's preference data (prompt then answer, strings) against TRL's tokenization of the same file:
    the same tokens, the loss on the same ones (the answers and EOS)."""
    from launcher.bench.dpo.peer import tokenized

    folder, data = folder_and_pairs
    theirs = tokenized(str(folder), str(data), dpo.MAX_LEN)
    line = dpo.same_tokens(folder, data, theirs)
    assert line.strip().startswith("tokens: every pair the same on both sides")
    # a pair told apart is named: here TRL's answer of pair 1 without its EOS
    shorter = theirs.map(lambda pair, k: {"rejected_ids": pair["rejected_ids"][:-1] if k == 1 else pair["rejected_ids"]},
                         with_indices=True)
    with pytest.raises(SystemExit, match=r"pair 1's rejected is not the same tokens on both sides"):
        dpo.same_tokens(folder, data, shorter)


def test_the_launcher_reads_conversational_pairs_as_the_same_tokens_as_trl(folder_and_pairs, tmp_path):
    """The row's default pairs: TRL scores an answer to its rendered text's end (ChatML's newline after <|im_end|>)
    and so does the launcher."""
    from launcher.bench.dpo.peer import tokenized

    folder, _ = folder_and_pairs
    dpo.write_pairs(tmp_path / "pairs.jsonl", 2 * dpo.BATCH, conversations=True)
    theirs = tokenized(str(folder), str(tmp_path / "pairs.jsonl"), dpo.MAX_LEN)
    assert dpo.same_tokens(folder, tmp_path / "pairs.jsonl", theirs).strip().startswith("tokens: every pair the same")


NUMBER = r"(\d+\.\d+)"


@pytest.mark.slow
@pytest.mark.measuring
def test_the_dpo_row_stands_against_trl():
    pytest.importorskip("trl", reason="the trl extra is not installed")
    # the loss's agreement is what this test holds, at step 200, on the row's conversational pairs
    out = bench("--dpo", "--dpo-steps", "200")
    assert "(python -m launcher.bench --dpo --dpo-steps 200 --reps 1)" in out, out
    assert "tokens: every pair the same on both sides" in out, out
    losses = {}
    for side in ("ours, recipes/hf_dpo", "TRL DPOTrainer"):
        row = re.search(rf"^{re.escape(side)} +{NUMBER}ms +\(\S+\) +{NUMBER}ms +{NUMBER}$", out, re.M)
        assert row, out
        step, cpu, losses[side] = map(float, row.groups())
        assert step > 0 and cpu > 0 and 0 < losses[side] < math.log(2), out  # both sides learnt something
    gap = re.search(r"^loss at step 200: \|ours - TRL\| / TRL (\S+), (NOT )?within 1% \(issue 53\)", out, re.M)
    assert gap and float(gap.group(1)) <= 0.01 and not gap.group(2), out  # issue 53: within 1%
    ratio = re.search(rf"^ours / TRL step: {NUMBER} \({NUMBER}-{NUMBER}\) wall, {NUMBER} \({NUMBER}-{NUMBER}\) CPU",
                      out, re.M)
    # a sanity bound on what was measured, not a target
    assert ratio and plausible(float(ratio.group(1))) and plausible(float(ratio.group(4))), out
