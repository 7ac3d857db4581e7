"""Tokenizing in several processes (TextDataset's num_proc, launcher/data/text/samples.py's in_processes): the
same samples, counts and lines at start as one process, across the windows the rows are handed out in, a
malformed row's problem coming back from its process as the serial path has it (one spawn of two processes:
seconds, for their imports of torch and transformers); num_proc: auto takes processes only for large
files, and shares a machine's CPUs among its ranks when every rank tokenizes."""

import json
import re

import pytest

from tests.text_folders import tokenizer_folder

pytest.importorskip("transformers", reason="the dev extra (transformers) is not installed")

from launcher.data.text import TextDataset  # noqa: E402
from launcher.data.text import dataset as text_dataset, samples  # noqa: E402

ROWS = 700  # over CHUNK (256) x 2 processes: several parts, in more than one window when CHUNK is small


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A tokenizer folder and a file of conversations of different lengths, row 500 not JSON."""
    where = tmp_path_factory.mktemp("processes")
    folder = tokenizer_folder(where)
    lines = []
    for i in range(ROWS):
        words = " ".join(["and so on"] * (i % 17))
        lines.append(json.dumps({"messages": [{"role": "user", "content": f"Question {i}: what is {i} plus 1? {words}"},
                                              {"role": "assistant", "content": f"It is {i + 1}. {words}"}]}))
    lines[499] = "{not json"
    (where / "chat.jsonl").write_text("\n".join(lines) + "\n")
    return str(folder), str(where / "chat.jsonl")


def build(folder, data, **settings):
    return TextDataset(folder, data, max_len=48, cache=None, bad_rows="skip", **settings)


@pytest.mark.slow  # a longer run: left out of the fast tier (-m "not slow")
def test_two_processes_give_one_process_samples_counts_and_lines(made, monkeypatch):
    folder, data = made
    one = build(folder, data)
    monkeypatch.setattr(samples, "CHUNK", 100)  # 700 rows: windows of 800 rows, parts of 100 (the parent's value)
    two = build(folder, data, num_proc=2)
    assert len(one.samples) > 100 and two.samples == one.samples
    assert two.notes == one.notes
    assert any("longer than max_len 48" in line for line in one.notes)  # truncation counted alike
    assert re.search(r"^1 malformed row skipped \(bad_rows: skip\); the first: \S*chat\.jsonl, line 500: ",
                     "\n".join(one.notes), re.M), one.notes


@pytest.mark.parametrize("wrong", [0, -1, "all", True, 1.5])
def test_num_proc_is_auto_or_a_count(made, wrong):
    folder, data = made
    with pytest.raises(ValueError, match=r"num_proc: .*: auto, or the number of processes that tokenize"):
        build(folder, data, num_proc=wrong)


def test_auto_takes_processes_for_large_files_alone_and_shares_the_cpus_of_ranks_without_a_cache(made, monkeypatch):
    _, data = made
    files = text_dataset._size(samples.sources.paths(data))  # their bytes
    assert text_dataset._processes(files, "auto", alone=True) == 1  # a small file: no processes to spawn
    assert text_dataset._processes(files, 3, alone=True) == 3
    monkeypatch.setattr(text_dataset, "LARGE", 1)
    monkeypatch.setattr(text_dataset.os, "sched_getaffinity", lambda pid: set(range(32)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert text_dataset._processes(files, "auto", alone=True) == text_dataset.MAX_PROCESSES == 8
    assert text_dataset._processes(files, "auto", alone=False) == 8  # 32 CPUs among 4 ranks
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert text_dataset._processes(files, "auto", alone=False) == 4
