"""The model folder's tokenizer (launcher/data/text/tokenizer.py): untrusted input, its JSON checked before
transformers reads it and nothing in it run; a folder without a tokenizer, or without a chat template, is one
line; special tokens as the tokenizer defines them (no PAD: EOS stands in)."""

import json
import resource
import shutil

import pytest

from tests.conftest import REPO
from tests.hostile import deep
from tests.text_folders import tokenizer_folder

pytest.importorskip("transformers", reason="the dev extra (transformers) is not installed")

from launcher.data.text import tokenizer as tokenizers  # noqa: E402
from launcher.errors import UserError  # noqa: E402


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return tokenizer_folder(tmp_path_factory.mktemp("tokenizer"))


def copy(good, tmp_path, name="copy"):
    return shutil.copytree(good, tmp_path / name)


def refused(folder) -> str:
    with pytest.raises(UserError) as e:
        tokenizers.load(str(folder))
    assert "\n" not in str(e.value)
    return str(e.value)


def test_special_tokens_as_the_tokenizer_defines_them(good, tmp_path):
    bpe = tokenizers.load(str(good))
    assert tokenizers.pad_id(bpe) == bpe.eos_token_id == 1  # no PAD: EOS stands in
    assert tokenizers.described(bpe) == "BOS '<s>' (0), EOS '</s>' (1), no PAD (EOS stands in for it)"
    byte_level = tokenizers.load(str(tokenizer_folder(tmp_path, "byte_level")))
    assert tokenizers.pad_id(byte_level) == byte_level.pad_token_id != byte_level.eos_token_id
    assert tokenizers.described(byte_level) == ("BOS '<|endoftext|>' (379), EOS '<|endoftext|>' (379), "
                                                "PAD '<|pad|>' (380)")


def test_a_folder_without_a_tokenizer_is_one_line(tmp_path):
    from recipes.components.hf_folder import write

    write(str(tmp_path / "model"), tokenizer=False)
    assert refused(tmp_path / "model") == (
        f"tokenizer: {tmp_path / 'model'}: no tokenizer.json, so no tokenizer to read; a tokenizer's "
        f"save_pretrained(folder) writes it (the launcher reads no other layout)")
    (tmp_path / "model" / "tokenizer.model").write_bytes(b"sentencepiece")
    assert "(it has tokenizer.model: a slow tokenizer's files, which the launcher does not convert)" in \
        refused(tmp_path / "model")
    assert refused(tmp_path / "nowhere").startswith(f"tokenizer: {tmp_path / 'nowhere'}: no such folder")


def test_a_folder_without_a_chat_template_is_one_line(good, tmp_path):
    folder = copy(good, tmp_path)
    (folder / "chat_template.jinja").unlink()
    tokenizer = tokenizers.load(str(folder))
    with pytest.raises(UserError, match="the tokenizer has no chat template .* give one as the dataset's chat_template"):
        tokenizers.chat_template(tokenizer, None, str(folder))
    assert tokenizers.chat_template(tokenizer, "{{ messages }}", str(folder)) == "{{ messages }}"


def test_hostile_tokenizer_files_are_one_line_each(good, tmp_path):
    folder = copy(good, tmp_path)
    config = folder / "tokenizer_config.json"
    config.write_bytes(deep())  # 200,000 levels
    assert refused(folder).startswith(f"{config}: nested deeper than Python's JSON parser goes")
    config.write_text("[" * 100 + "]" * 100)  # not an object
    assert refused(folder) == f"{config}: holds a list; a tokenizer config is a JSON object"
    config.write_text(json.dumps({"a": json.loads("[" * 100 + "]" * 100)}))  # Python reads it; the tokenizers library would not
    assert refused(folder) == f"{config}: nested more than 32 levels deep; a tokenizer config is JSON a few levels deep"
    with open(config, "wb") as f:
        f.truncate(1 << 40)  # a terabyte that takes no disk
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert refused(folder).startswith(f"{config}: more than 64 MiB; a tokenizer config is a few KB of JSON")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200 << 10  # KiB: 64 MiB read at most
    config.write_bytes((good / "tokenizer_config.json").read_bytes())
    whole = json.loads((good / "tokenizer.json").read_text())
    (folder / "tokenizer.json").write_text(json.dumps({**whole, "model": {**whole["model"], "type": "NotAModel"}}))
    assert refused(folder).startswith(f"tokenizer: {folder}/tokenizer.json: the tokenizers library cannot read it: ")
    (folder / "tokenizer.json").write_text(json.dumps({"model": {}}))  # what transformers reads itself first
    assert refused(folder) == f"tokenizer: {folder}: transformers cannot read its tokenizer: KeyError: 'added_tokens'"
    (folder / "tokenizer.json").write_bytes((good / "tokenizer.json").read_bytes())
    with open(folder / "chat_template.jinja", "wb") as f:
        f.truncate(1 << 30)
    assert refused(folder) == f"{folder / 'chat_template.jinja'}: more than 1 MiB; a chat template is a few KB of Jinja"


def test_nothing_in_the_folder_runs(good, tmp_path):
    folder = copy(good, tmp_path)
    marker = tmp_path / "ran"
    (folder / "evil_tokenizer.py").write_text(f"open({str(marker)!r}, 'w').close()\nfrom transformers import "
                                              f"PreTrainedTokenizerFast as EvilTokenizer\n")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="EvilTokenizer", auto_map={"AutoTokenizer": [None, "evil_tokenizer.EvilTokenizer"]})
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = tokenizers.load(str(folder))
    assert not marker.exists() and type(tokenizer).__name__ == "TokenizersBackend"
    assert tokenizer("What is 3 plus 4?")["input_ids"] == tokenizers.load(str(good))("What is 3 plus 4?")["input_ids"]


def test_a_hostile_tokenizer_in_a_recipe_is_one_line_and_exit_2(tmp_path, capsys):
    """Through the command line, as a user meets it: the model builds, the data's folder is refused."""
    from launcher.cli import main
    from recipes.components.hf_folder import write

    write(str(tmp_path / "model"))
    (tmp_path / "model" / "tokenizer_config.json").write_bytes(deep())
    code = main([str(REPO / "recipes" / "hf_sft.yaml"), f"model.config.pretrained_model_name_or_path={tmp_path / 'model'}",
                 f"run_dir={tmp_path / 'run'}", "on_cpu=null", "precision=fp32", "logging.tensorboard=false",
                 "logging.progress_bar=false"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"launcher: {tmp_path / 'model' / 'tokenizer_config.json'}: nested deeper than Python's JSON "
                          f"parser goes")


def with_split(good, tmp_path, regex, name="split"):
    """A copy of the folder whose pre-tokenizer splits on `regex` first (a Split in a Sequence)."""
    folder = copy(good, tmp_path, name)
    whole = json.loads((folder / "tokenizer.json").read_text())
    split = {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}
    whole["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [split, *filter(None, [whole["pre_tokenizer"]])]}
    (folder / "tokenizer.json").write_text(json.dumps(whole))
    return folder


def test_a_pre_tokenizer_regex_that_backtracks_exponentially_is_one_line_at_load(good, tmp_path):
    """(a|a)+b: a row of 23 a's made the tokenizers library panic (a Rust backtrace, a Python traceback); one of 22
    took 0.2 s, so that a row of a thousand such words took minutes. Refused before the library reads the file."""
    folder = with_split(good, tmp_path, "(a|a)+b")
    assert refused(folder) == (
        f"tokenizer: {folder / 'tokenizer.json'}: its pre-tokenizer regex '(a|a)+b' repeats '(a|a)+', a group that "
        f"can match in more than one way: the tokenizers library backtracks through it exponentially (past its limit "
        f"it panics, below it a row takes hours); repeat a character or a class instead, as the regexes of models' "
        f"tokenizers do")


@pytest.mark.parametrize("regex", [
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",  # GPT-2
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|"
    r"\s+",  # Llama 3 (Qwen2's: \p{N} alone)
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",  # o200k (Mistral's Tekken alike)
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+",  # DeepSeek-V3
    r" ?[^(\s|[.,!?…。，、।۔،])]+",  # BLOOM: a nested class
])
def test_the_regexes_of_models_tokenizers_are_taken(good, tmp_path, regex):
    folder = with_split(good, tmp_path, regex)
    assert tokenizers.load(str(folder))("What is 3 plus 4?")["input_ids"]


def test_a_row_on_which_the_tokenizers_library_panics_is_one_line_naming_the_row_and_the_file(good, tmp_path):
    """A regex with no repeated group can still pass Oniguruma's backtracking limit (eight \\s* in a row on 60
    spaces): the library's PanicException (a BaseException, which no `except Exception` took) is one line."""
    from launcher.data.text import TextDataset

    folder = with_split(good, tmp_path, r"\s*\s*\s*\s*\s*\s*\s*\s*\d")
    path = tmp_path / "text.jsonl"
    path.write_text(json.dumps({"text": "What is 3 plus 4?"}) + "\n" + json.dumps({"text": " " * 60 + "!"}) + "\n")
    with pytest.raises(UserError) as e:
        TextDataset(str(folder), str(path), format="text", cache=None)
    assert str(e.value) == (
        f"{path}, line 2: tokenizer: {folder / 'tokenizer.json'}: the tokenizers library panicked on it: Onig: Regex "
        f"search error: retry-limit-in-match over: a regex of its normalizer or pre-tokenizer backtracks on this row; "
        f"give the tokenizer regexes that repeat characters and classes, as models' tokenizers do")


def test_a_row_whose_tokenizing_passes_its_backstop_is_one_line(good, tmp_path, monkeypatch):
    """Just below Oniguruma's limit, each word of 22 spaces takes 0.2 s of CPU or more (a row of thousands: hours).
    The library's call cannot be metered: a backstop of wall-clock time (60 s, and more for a long text; here 0.05 s,
    which the row's 8 words pass whatever the machine) makes it one line, where the library gave its samples after
    hours."""
    from launcher.data.text import TextDataset, formats

    folder = with_split(good, tmp_path, r"\s*\s*\s*\s*\s*\s*\s*\s*\d")
    path = tmp_path / "text.jsonl"
    path.write_text(json.dumps({"text": (" " * 22 + "!") * 8}) + "\n")
    monkeypatch.setattr(formats, "SECONDS", 0.05)
    monkeypatch.setattr(formats, "CHARACTERS_A_SECOND", 1e12)
    with pytest.raises(UserError) as e:
        TextDataset(str(folder), str(path), format="text", cache=None)
    assert str(e.value) == (
        f"{path}, line 1: tokenizer: {folder / 'tokenizer.json'}: the tokenizers library took more than 0 s on it (a "
        f"backstop of wall-clock time): a regex of its normalizer or pre-tokenizer backtracks on this row; give the "
        f"tokenizer regexes that repeat characters and classes, as models' tokenizers do")
