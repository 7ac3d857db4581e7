"""The token cache (launcher/data/text/cache.py): a second build reads what the first tokenized, the same samples
and lines at start, without tokenizing; whatever shapes a sample (a file's bytes, even with its size and mtime
put back, the chat template given or the folder's, the tokenizer, max_len) makes it tokenize anew; a truncated,
corrupted or hostile entry is one line and rebuilt; two processes building at once both end with the right
samples; cache: null writes nothing."""

import json
import multiprocessing
import os
import resource
import struct

import pytest

from tests.pace import paced
from tests.text_folders import tokenizer_folder

pytest.importorskip("transformers", reason="the dev extra (transformers) is not installed")

from launcher.data.text import TextDataset, cache  # noqa: E402
from launcher.data.text import dataset as text_dataset  # noqa: E402

CONVERSATIONS = [
    [{"role": "user", "content": "What is 3 plus 4?"}, {"role": "assistant", "content": "3 plus 4 is 7."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "And 2 times 5?"},
     {"role": "assistant", "content": "2 times 5 is 10. Thank you!"}],
    [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hello! How can I help you today?"}],
]
OTHER_TEMPLATE = ("{% for message in messages %}[{{ message['role'] }}] {{ message['content'] }}</s>\n{% endfor %}"
                  "{% if add_generation_prompt %}[assistant] {% endif %}")


@pytest.fixture
def made(tmp_path):
    """A tokenizer folder, a file of conversations, and the cache folder to keep their samples in."""
    folder = tokenizer_folder(tmp_path)
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS))
    return str(folder), str(data), tmp_path / "cache"


def build(folder, data, where, **settings):
    return TextDataset(folder, data, max_len=64, cache=str(where) if where else None, **settings)


def entry(where):
    found = sorted(where.glob("*.safetensors"))
    assert len(found) == 1, found
    return found[0]


def test_a_second_build_reads_the_cache_without_tokenizing(made, monkeypatch):
    folder, data, where = made
    first = build(folder, data, where)
    path = entry(where)
    assert first.notes[-1] == f"tokenized 3 rows, cached at {path}"

    def tokenizes(*args, **kwargs):
        raise AssertionError("the tokenizer was called")

    monkeypatch.setattr(text_dataset, "_tokenized", tokenizes)
    monkeypatch.setattr(type(first.tokenizer), "__call__", tokenizes)
    second = build(folder, data, where)
    assert second.samples == first.samples and second.rows == first.rows
    assert second.notes[:-1] == first.notes[:-1] and second.notes[-1] == f"cache: hit {path}"
    assert [second[i]["input_ids"].tolist() for i in range(3)] == [s["input_ids"] for s in first.samples]


def test_the_notes_are_the_same_from_the_cache_with_packing_skipped_and_truncated_rows(made, tmp_path):
    folder, _, where = made
    rows = [json.dumps({"messages": m}) for m in CONVERSATIONS] * 3 + ['{"messages": []}', "not json"]
    data = tmp_path / "mixed.jsonl"
    data.write_text("\n".join(rows) + "\n")
    settings = dict(bad_rows="skip", packing=True, batch_size=2)
    fresh, again = (TextDataset(folder, str(data), max_len=24, cache=str(where), **settings) for _ in range(2))
    assert fresh.notes[-1].startswith("tokenized 11 rows, cached at ") and again.notes[-1].startswith("cache: hit ")
    # the tokenizer, the rows, the truncated, the skipped, packing, the cache
    assert again.notes[:-1] == fresh.notes[:-1] and len(fresh.notes) == 6
    assert again.samples == fresh.samples and again.rows == fresh.rows


@pytest.mark.parametrize("format, name, text", [
    ("text", "docs.txt", "The quick brown fox jumps over the lazy dog. " * 6),
    ("prompt_completion", "pc.csv", "prompt,completion\nWhat is 9 times 3?, 27\nWhat is 12 plus 7?, 19\n")])
def test_every_format_reads_back_what_it_tokenized(made, tmp_path, format, name, text):
    folder, _, where = made
    (tmp_path / name).write_text(text)
    first, second = (TextDataset(folder, str(tmp_path / name), format=format, max_len=16, cache=str(where))
                     for _ in range(2))
    assert second.notes[-1] == f"cache: hit {entry(where)}" and first.notes[-1].startswith("tokenized ")
    assert second.samples == first.samples and second.notes[:-1] == first.notes[:-1]
    assert TextDataset(folder, str(tmp_path / name), format=format, max_len=16, cache=None).samples == first.samples


def rewrite_keeping_size_and_mtime(path, old, new):
    assert len(old) == len(new)
    stat = os.stat(path)
    with open(path, "r+b") as f:
        text = f.read()
        f.seek(0)
        f.write(text.replace(old, new))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert os.stat(path).st_size == stat.st_size and os.stat(path).st_mtime_ns == stat.st_mtime_ns


def change_the_file(folder, data):
    rewrite_keeping_size_and_mtime(data, b"3 plus 4 is 7.", b"3 plus 4 is 8.")
    return folder, {}, "the files changed"


def change_the_folders_template(folder, data):
    template = os.path.join(folder, "chat_template.jinja")
    with open(template, "w") as f:
        f.write(OTHER_TEMPLATE)
    return folder, {}, None  # the template used is in the entry's name: another entry


def change_the_tokenizer(folder, data):
    from recipes.components.tiny_tokenizer import SENTENCES, bpe

    bpe(vocab=200, sentences=SENTENCES[:3]).save_pretrained(folder)  # fewer merges: other tokens
    return folder, {}, "the tokenizer changed"


def give_a_chat_template(folder, data):
    return folder, {"chat_template": OTHER_TEMPLATE}, None


def change_max_len(folder, data):
    return folder, {"max_len": 20}, None


@pytest.mark.parametrize("change", [change_the_file, change_the_folders_template, change_the_tokenizer,
                                    give_a_chat_template, change_max_len])
def test_what_shapes_a_sample_changed_tokenizes_anew(made, change):
    folder, data, where = made
    before = build(folder, data, where)
    folder, settings, why = change(folder, data)
    after = TextDataset(folder, data, cache=str(where), **{"max_len": 64, **settings})
    assert after.notes[-1].startswith("tokenized 3 rows") and "cached at" in after.notes[-1]
    if why:  # the same entry, rebuilt in place
        assert after.notes[-1] == f"tokenized 3 rows ({why} since the entry there was made), cached at {entry(where)}"
    else:  # another entry beside the first
        assert len(list(where.glob("*.safetensors"))) == 2
    fresh = TextDataset(folder, data, cache=None, **{"max_len": 64, **settings})
    assert after.samples == fresh.samples != before.samples
    assert after.notes[:-1] == fresh.notes[:-1]
    assert TextDataset(folder, data, cache=str(where), **{"max_len": 64, **settings}).notes[-1].startswith("cache: hit")


def truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 10)


def flip_a_token(path):
    raw = bytearray(path.read_bytes())
    raw[-40] ^= 0x01  # a bit of the arrays (a token or a label): the header is whole, the CRC-32 fails
    path.write_bytes(bytes(raw))


def garble_the_header(path):
    raw = path.read_bytes()
    path.write_bytes(raw[:8] + b"{not json" + raw[17:])


@pytest.mark.parametrize("damage", [truncate, flip_a_token, garble_the_header])
def test_a_damaged_entry_is_one_line_and_rebuilt(made, damage):
    folder, data, where = made
    first = build(folder, data, where)
    path = entry(where)
    damage(path)
    again = build(folder, data, where)
    assert again.notes[-1].startswith(f"cache: {path}: unreadable (") and \
        again.notes[-1].endswith("); tokenized 3 rows anew and cached there"), again.notes[-1]
    assert again.samples == first.samples and again.notes[:-1] == first.notes[:-1]
    assert build(folder, data, where).notes[-1] == f"cache: hit {path}"


def header_of(path):
    raw = path.read_bytes()
    size = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + size])


def written(path, header, data=b""):
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)


def huge_shape(path):
    header = header_of(path)
    header["input_ids"] = {"dtype": "I32", "shape": [1 << 40], "data_offsets": [0, 4 << 40]}
    written(path, header, b"\0" * 64)
    return "unreadable ("


def wrong_dtype(path):
    import numpy as np
    from safetensors.numpy import save_file

    from safetensors import safe_open

    with safe_open(str(path), framework="np") as f:
        meta, arrays = f.metadata(), {name: f.get_tensor(name) for name in f.keys()}
    arrays["input_ids"] = arrays["input_ids"].astype(np.float64)
    save_file(arrays, str(path), metadata=meta)
    return "unreadable (input_ids is F64 of shape"


def negative_token(path):
    """A forged entry, whole by its own CRC-32 and counts: a token id of -5 (and its label) where the model's
    embedding would read it (before, it was read as a sample, and the model's failure blamed the recipe)."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    with safe_open(str(path), framework="np") as f:
        meta, arrays = f.metadata(), {name: f.get_tensor(name).copy() for name in f.keys()}
    arrays["input_ids"][1] = arrays["labels"][1] = -5
    meta["crc32"] = str(cache._crc(arrays))
    save_file(arrays, str(path), metadata=meta)
    return "unreadable (it holds the token id -5; a token id is 0 or more)"


def another_datasets_key(path):
    header = header_of(path)
    key = json.loads(header["__metadata__"]["key"])
    key["where"]["settings"]["max_len"] = 2048
    header["__metadata__"]["key"] = json.dumps(key)
    raw = path.read_bytes()
    written(path, header, raw[8 + struct.unpack("<Q", raw[:8])[0]:])
    return "unreadable: its key is not this dataset's"


@pytest.mark.parametrize("craft", [huge_shape, wrong_dtype, negative_token, another_datasets_key])
def test_a_hostile_entry_is_refused_before_anything_is_allocated_and_rebuilt(made, craft):
    folder, data, where = made
    first = build(folder, data, where)
    path = entry(where)
    said = craft(path)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    again = build(folder, data, where)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 256 << 10  # KiB: no 4 TiB array was made
    assert again.notes[-1].startswith(f"cache: {path}: {said}"), again.notes[-1]
    assert again.samples == first.samples
    assert build(folder, data, where).notes[-1] == f"cache: hit {path}"


def _build_in_a_process(folder, data, where, start, out):
    start.wait()  # both processes past their imports: they build at once
    built = build(folder, data, where)
    out.put((built.samples, built.notes[-1]))


@pytest.mark.slow  # a longer run: left out of the fast tier (-m "not slow")
def test_two_processes_building_at_once_both_end_with_the_right_samples(made):
    folder, data, where = made
    spawn = multiprocessing.get_context("spawn")
    start, out = spawn.Barrier(2), spawn.Queue()
    processes = [spawn.Process(target=_build_in_a_process, args=(folder, data, where, start, out)) for _ in range(2)]
    for process in processes:
        process.start()
    results = [out.get(timeout=paced(240)) for _ in processes]
    for process in processes:
        process.join(timeout=paced(60))
        assert process.exitcode == 0
    fresh = build(folder, data, None)
    assert [samples == fresh.samples for samples, _ in results] == [True, True]
    path = entry(where)
    # one tokenized while the other waited on the lock, then read what it wrote
    assert sorted(line for _, line in results) == [f"cache: hit {path}", f"tokenized 3 rows, cached at {path}"]
    assert sorted(p.name for p in where.iterdir()) == [path.with_suffix(".lock").name, path.name]  # no partial file


def test_a_build_stopped_mid_write_leaves_no_entry(made, monkeypatch):
    import safetensors.numpy

    folder, data, where = made

    def stopped(arrays, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"input_ids\": ")  # half a header, then ^C
        raise KeyboardInterrupt

    with monkeypatch.context() as patched, pytest.raises(KeyboardInterrupt):
        patched.setattr(safetensors.numpy, "save_file", stopped)
        build(folder, data, where)
    assert list(where.glob("*.safetensors")) == [] and list(where.glob("*.partial")) == []
    assert build(folder, data, where).notes[-1] == f"tokenized 3 rows, cached at {entry(where)}"


def test_an_entry_that_cannot_be_written_is_said_and_the_run_goes_on(made, monkeypatch):
    folder, data, where = made

    def full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cache.os, "replace", full)
    built = build(folder, data, where)
    assert built.notes[-1].startswith("tokenized 3 rows, not cached: ") and "No space left on device" in \
        built.notes[-1]
    assert list(where.glob("*.safetensors")) == [] and list(where.glob("*.partial")) == []


@pytest.mark.parametrize("off", [None, False])
def test_cache_null_writes_nothing(made, tmp_path, monkeypatch, off):
    folder, data, _ = made
    monkeypatch.setenv("LAUNCHER_CACHE", str(tmp_path / "default"))
    built = TextDataset(folder, data, max_len=64, cache=off)
    assert built.notes[-1] == "tokenized 3 rows, not cached (cache: null)"
    assert not (tmp_path / "default").exists()
    TextDataset(folder, data, max_len=64)  # the default: true
    assert len(list((tmp_path / "default" / "text").glob("*.safetensors"))) == 1


@pytest.mark.parametrize("env, expected", [
    ({"LAUNCHER_CACHE": "/scratch/me", "XDG_CACHE_HOME": "/xdg"}, "/scratch/me/text"),
    ({"XDG_CACHE_HOME": "/xdg"}, "/xdg/launcher/text"),
    ({"HOME": "/home/me"}, "/home/me/.cache/launcher/text"),
])
def test_the_default_folder_is_chosen_as_hf_datasets_chooses_its_own(env, expected, monkeypatch):
    monkeypatch.setenv("HOME", "/home/me")
    assert str(cache.folder(True, env)) == expected
    assert str(cache.folder("~/elsewhere", env)) == "/home/me/elsewhere"
    assert cache.folder(None, env) is None and cache.folder(False, env) is None


def test_a_cache_that_is_not_a_folder_nor_a_flag_is_the_recipes_mistake(made):
    folder, data, _ = made
    with pytest.raises(ValueError, match=r"^cache: 3: true \(the default folder\), a folder, or null"):
        TextDataset(folder, data, cache=3)


@pytest.mark.parametrize("size, terminal, rank, shown", [
    (64 << 20, True, None, True), (64 << 20, True, "0", True), ((64 << 20) - 1, True, None, False),
    (64 << 20, False, None, False), (64 << 20, True, "1", False)])
def test_a_progress_bar_only_for_large_files_on_a_terminal_on_rank_0(tmp_path, monkeypatch, size, terminal, rank,
                                                                     shown):
    data = tmp_path / "big.jsonl"
    with open(data, "wb") as f:
        f.truncate(size)  # sparse: nothing written
    monkeypatch.setattr(text_dataset.sys.stderr, "isatty", lambda: terminal)
    if rank is not None:
        monkeypatch.setenv("RANK", rank)
    assert text_dataset._progress(text_dataset._size([data])) is shown


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_an_entry_is_written_with_the_mode_the_umask_gives(made, umask):
    """A cache a team shares (umask 002, a group-writable folder) serves every reader: an entry's mode is what
    open() gives a new file, not mkstemp's 0600, which only its writer could read."""
    folder, data, where = made
    before = os.umask(umask)
    try:
        build(folder, data, where)
    finally:
        os.umask(before)
    assert entry(where).stat().st_mode & 0o777 == 0o666 & ~umask
