"""Packing as a pure function (launcher/data/text/packing.py): the rows are a function of (samples,
max_len, seed) alone, never exceed max_len, hold every sample once with its tokens, labels (the first of
each sample -100), positions restarting at 0 and its document number; best-fit decreasing fills them;
the Packed collate pads rows so that padding is a sample of its own; the padding line at start."""

import random
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from launcher.data.collate import Packed
from launcher.data.text.packing import IGNORE_INDEX, join, pack, padding, plan
from tests.conftest import REPO

lengths_lists = st.lists(st.integers(1, 64), min_size=0, max_size=120)


def samples_of(lengths, seed=0):
    draw = random.Random(seed)
    out = []
    for n in lengths:
        ids = [draw.randrange(256) for _ in range(n)]
        out.append({"input_ids": ids, "labels": [draw.choice([IGNORE_INDEX, i]) for i in ids]})
    return out


def documents(row):
    """The samples a row holds, read back by its document_ids: (input_ids, labels, position_ids) each."""
    out = {}
    for key in ("input_ids", "labels", "position_ids"):
        for doc, value in zip(row["document_ids"], row[key]):
            out.setdefault(doc, {}).setdefault(key, []).append(value)
    return [out[d] for d in sorted(out)]


@settings(max_examples=150, deadline=None)
@given(lengths=lengths_lists, extra=st.integers(0, 64), seed=st.integers(0, 2**32))
def test_rows_hold_every_sample_once_within_max_len_with_its_positions_and_boundary_labels(lengths, extra, seed):
    max_len = max(lengths, default=1) + extra
    samples = samples_of(lengths, seed)
    rows = pack(samples, max_len, seed)
    assert rows == pack(samples, max_len, seed)  # the same rows on every call
    found = []
    for row in rows:
        assert set(row) == {"input_ids", "labels", "position_ids", "document_ids"}
        assert 1 <= len(row["input_ids"]) <= max_len
        assert len({len(v) for v in row.values()}) == 1
        docs = documents(row)
        assert sorted(set(row["document_ids"])) == list(range(len(docs)))
        assert row["document_ids"] == sorted(row["document_ids"])  # each sample in one piece
        for doc in docs:
            assert doc["position_ids"] == list(range(len(doc["input_ids"])))
            assert doc["labels"][0] == IGNORE_INDEX
            found.append(doc)
    assert len(found) == len(samples)
    # every sample exactly once: its tokens, and its labels but the first
    key = lambda s: (s["input_ids"], s["labels"][1:])  # noqa: E731
    assert sorted(map(key, found)) == sorted(map(key, samples))


@settings(max_examples=100, deadline=None)
@given(lengths=lengths_lists, seed=st.integers(0, 1000))
def test_the_plan_is_a_function_of_lengths_max_len_and_seed(lengths, seed):
    rows = plan(lengths, 64, seed)
    assert rows == plan(list(lengths), 64, seed)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 64 for row in rows)


def test_best_fit_decreasing_fills_rows_and_the_seed_only_breaks_ties():
    lengths = [7, 5, 3, 3, 2, 9, 1, 10]  # 40 tokens: four full rows of 10 exist
    rows = plan(lengths, 10, seed=0)
    assert sorted(sorted(lengths[i] for i in row) for row in rows) == [[1, 9], [2, 3, 5], [3, 7], [10]]
    assert all(sorted(sorted(lengths[i] for i in row) for row in plan(lengths, 10, seed)) ==
               [[1, 9], [2, 3, 5], [3, 7], [10]] for seed in range(20))
    assert len({tuple(map(tuple, plan(lengths, 10, seed))) for seed in range(20)}) > 1  # the seed orders rows
    draw = random.Random(0)
    many = [draw.randint(1, 100) for _ in range(2000)]
    assert len(plan(many, 128, seed=0)) <= -(-sum(many) // 128) + 1  # within a row of the least possible


@pytest.mark.slow  # a longer run: left out of the fast tier (-m "not slow")
def test_the_rows_do_not_depend_on_the_process_hash_seed_or_the_rank():
    """What each rank of a run computes in its own process: the same rows (no set or hash order inside)."""
    code = ("import json, random; from launcher.data.text.packing import plan; d = random.Random(1); "
            "print(json.dumps(plan([d.randint(1, 50) for _ in range(500)], 64, 7)))")
    outs = {subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": str(h), "RANK": str(h), "WORLD_SIZE": "4", "PATH": "/usr/bin:/bin"}
                           ).stdout for h in (0, 3)}
    assert len(outs) == 1 and outs.pop().startswith("[[")


@pytest.mark.parametrize("lengths, max_len, said", [
    ([3, 11, 2], 10, "sample 1 has 11 tokens: packing takes samples of 1 to max_len (10) tokens; truncate or drop "
                     "the others before packing"),
    ([3, 0], 10, "sample 1 has 0 tokens"),
    ([3], 0, "max_len must be at least 1, got 0"),
])
def test_a_sample_longer_than_max_len_or_empty_is_a_bug_of_the_caller(lengths, max_len, said):
    with pytest.raises(ValueError, match=said.replace("(", r"\(").replace(")", r"\)")):
        plan(lengths, max_len, seed=0)


def test_join_takes_tensors_and_refuses_labels_of_another_length():
    row = join([{"input_ids": torch.tensor([5, 6]), "labels": torch.tensor([5, 6])},
                {"input_ids": [7, 8, 9], "labels": [-100, 8, 9]}])
    assert row == {"input_ids": [5, 6, 7, 8, 9], "labels": [-100, 6, -100, 8, 9], "position_ids": [0, 1, 0, 1, 2],
                   "document_ids": [0, 0, 1, 1, 1]}
    with pytest.raises(ValueError, match="a sample has 2 input_ids and 1 labels"):
        join([{"input_ids": [1, 2], "labels": [1]}])


def test_the_packed_collate_pads_rows_as_a_sample_of_their_own():
    rows = [join([{"input_ids": [5, 6], "labels": [5, 6]}, {"input_ids": [7], "labels": [7]}]),
            join([{"input_ids": [1], "labels": [1]}])]
    batch = Packed(pad_id=3)(rows)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [1, 3, 3]]
    assert batch["labels"].tolist() == [[-100, 6, -100], [-100, -100, -100]]
    assert batch["position_ids"].tolist() == [[0, 1, 0], [0, 0, 0]]
    assert batch["document_ids"].tolist() == [[0, 0, 1], [0, -1, -1]]
    assert Packed(multiple_of=4)(rows)["input_ids"].shape == (2, 4)


@pytest.mark.parametrize("lengths, max_len, batch, said", [
    ([4, 4, 4, 4], 8, 2, "packing: 4 samples into 2 rows of at most 8 tokens; padding in batches of 2: 0% of tokens "
                         "without packing, 0% packed"),
    ([1, 7], 8, 2, "packing: 2 samples into 1 row of at most 8 tokens; padding in batches of 2: 43% of tokens "
                   "without packing, 0% packed"),  # 6 of 14 tokens padded; one row of 8
    ([1] * 1000 + [100] * 10, 128, 16, "packing: 1,010 samples into 16 rows of at most 128 tokens; padding in "
                                       "batches of 16: 87% of tokens without packing, 2% packed"),
])
def test_the_padding_line_says_the_share_of_padding_without_and_with_packing(lengths, max_len, batch, said):
    assert padding(lengths, plan(lengths, max_len, 0), max_len, batch, seed=0) == said


def test_the_padding_share_counts_whole_batches_padded_to_their_longest():
    line = padding([2, 6], [[0], [1]], 8, 2, seed=0)  # one batch of two rows padded to 6: 4 of 12 tokens
    assert line.endswith("33% of tokens without packing, 33% packed"), line
