"""A model folder's chat template is untrusted code (DESIGN, invariant 13; launcher/data/text/sandbox.py and
bounds.py): each hostile template of tests/hostile.py (a 3 GB string, nested range(100000) loops, a string doubled
in a loop, a branching macro, ...) is one line naming the folder's template file and the bound it went past,
exit 2, in bounded memory, at start (the template check) and on every rank; one that goes past its bounds on
one row only names the row too, whatever bad_rows says. Before, the first grew a run to 12 GB, the loops hung
the template check on every rank, `'a' * 10**12` ended in MemoryError with a traceback. The bounds change no
rendering of a template that keeps to them: transformers' own text, on every template the tests hold."""

import json
import subprocess
import sys

import pytest

from tests import hostile
from tests.conftest import REPO
from tests.pace import paced
from tests.text_folders import MARKED, PARTS, QWEN25, tokenizer_folder
from recipes.components.tiny_tokenizer import CHATML, LLAMA3

pytest.importorskip("transformers", reason="the dev extra (transformers) is not installed")

from launcher.data.text import TextDataset, bounds, sandbox  # noqa: E402
from launcher.errors import UserError  # noqa: E402

RECIPE = str(REPO / "recipes" / "hf_sft.yaml")
SHORT = ["on_cpu=null", "precision=fp32", "trainer.max_steps=1", "trainer.log_every=1", "checkpoint.every=null",
         "logging.tensorboard=false", "logging.progress_bar=false", "trainer.activation_checkpointing=null",
         "data.batch_size=8", "data.train.max_len=64", "data.train.cache=null", "logging.memory_plan=false"]
MEMORY = 2 ** 30  # a process's peak resident memory, whichever template it met (one that trains: ~450 MB)
CONVERSATION = [{"role": "user", "content": "What is 3 plus 4?"}, {"role": "assistant", "content": "It is 7."}]


def limited():  # a regression fails on its own instead of taking the shared machine's memory
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    from recipes.components.hf_folder import write

    folder = tmp_path_factory.mktemp("templates") / "good"
    write(str(folder))
    return folder


@pytest.mark.slow  # over 3 s on a quiet machine: left out of the fast tier (-m 'not slow')
def test_hostile_templates_are_one_line_each_at_start_in_bounded_memory(good, tmp_path):
    """Every case through python -m launcher's main, all in one child process (its memory limited to 8 GB, its
    peak under MEMORY): the template check at start meets each."""
    jobs, expected = [], []
    for name, (_, says) in hostile.TEMPLATES.items():
        folder = hostile.template_folder(good, name, tmp_path)
        jobs.append(["launcher", RECIPE, f"model.config.pretrained_model_name_or_path={folder}",
                     f"run_dir={tmp_path / 'runs' / name}", *SHORT])
        expected.append((name, f"launcher: {folder / 'chat_template.jinja'}: rendering a conversation of two "
                               f"messages at start, the chat template {says}"))
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    done = subprocess.run([sys.executable, "-m", "tests.hostile", "--run", str(tmp_path / "jobs.json")], cwd=REPO,
                          capture_output=True, text=True, timeout=paced(600), preexec_fn=limited)
    assert done.returncode == 0, done.stderr[-3000:]
    *results, peak = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(expected), done.stdout[-3000:]
    for (name, prefix), got in zip(expected, results):
        lines = [line for line in got["stderr"].splitlines() if "launcher:" in line]
        assert got["code"] == 2 and len(lines) == 1 and "Traceback" not in got["stderr"], (name, got["stderr"][-3000:])
        assert lines[0].startswith(prefix) and "a template is untrusted code" in lines[0], (name, lines[0])
    assert peak["peak"] < MEMORY, f"peak resident memory {peak['peak'] / 2**20:.0f} MiB"


def test_a_template_past_its_bounds_on_one_row_names_the_row_and_the_template_whatever_bad_rows_says(tmp_path):
    # harmless at start (two messages), 5 MB on a row of four: the bounds for a row of 90 characters are 1 MiB
    explodes = "{% if messages | length > 3 %}{% set x = 'a' * 5000000 %}{% endif %}" + CHATML
    folder = tokenizer_folder(tmp_path, template=explodes)
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATION}) + "\n" + json.dumps({"messages": CONVERSATION * 2}) + "\n")
    for bad_rows in ("error", "skip"):
        with pytest.raises(UserError) as e:
            TextDataset(str(folder), str(path), cache=None, bad_rows=bad_rows)
        said = str(e.value)
        assert said.startswith(f"{path}, line 2: {folder / 'chat_template.jinja'}: rendering this row, the chat "
                               f"template would make a repeated value of 5,000,000 characters, more than the "
                               f"1,049,") and "\n" not in said, said


@pytest.mark.parametrize("template, says", [
    ("{{ 'ab' * 600 }}", "would make a repeated value of 1,200 characters"),
    ("{{ ['ab'] * 400 }}", "would make a repeated value of 1,600 characters"),  # 4 an element: the list's and 'ab'
    ("{{ 'x' ~ ('ab' * 500) ~ 'y' }}", "would make a joined string (~) of 1,002 characters"),
    ("{% set ns = namespace(l=[]) %}{% for i in range(1000) %}{% set ns.l = ns.l + [i] %}{% endfor %}",
     "made more than 16,000 characters of values in all"),  # each list a new copy: 1 + 2 + ... + 178
    ("{% for i in range(100) %}{% for j in range(100) %}{% endfor %}{% endfor %}", "ran more than 5,000 steps"),
    ("{{ 'a'.ljust(5000) }}", "would make a padded string of 5,000 characters"),
    ("{{ 'ab'.replace('', 'xyz' * 300) }}", "would make a replaced string of 2,702 characters"),
    ("{{ '{:>5000}'.format(1) }}", "would make a formatted string of 5,0"),
    ("{{ '%5000s' % 'a' }}", "would make a formatted string of 5,0"),
    ("{{ 'x' | indent(5000, true) }}", "would make an indented string of 5,001 characters"),
    ("{{ ['a', 'b', 'c'] | join('-' * 400) }}", "would make a joined string of 1,203 characters"),
    ("{{ range(300) | map('string') | join(',') }}", "would make a joined string of 1,"),
    ("{{ ('ab' * 200).join(['cd', 'ef', 'gh']) }}", "would make a joined string of 1,"),
    ("{{ {'k': 'a' * 990} | tojson(indent=2) }}", "would make a JSON text of 1,00"),
    ("{{ 'a' | center(5000) }}", "would make a centered string of 5,000 characters"),
    ("{{ ['x'] | batch(5000, 'y') | list }}", "would make a list of groups of 5,000 characters"),
    ("{{ 3 ** 10000 }}", "would make an integer of more than 8,192 bits"),
    ("{{ lipsum(100) }}", "would make lorem ipsum of 160,000 characters"),
    ("{% set y %}{% for i in range(1000) %}{{ 'ab' * 400 }}{% endfor %}{% endset %}",
     "made more than 16,000 characters of values in all"),
    ("{% for i in range(1000) %}{{ 'ab' * 400 }}{% endfor %}", "made more than 16,000 characters of values in all"),
    ("{% for i in range(4) %}{{ 'ab' * 200 }}{% endfor %}", "would make an output of 1,600 characters"),
])
def test_each_way_to_grow_a_value_is_refused_before_it_is_made(template, says):
    """Within a meter of 1,000 characters a value and 16,000 in all, 5,000 steps: what each would make is
    refused before it is made, where its size is known from its inputs."""
    meter = bounds.Meter(limit=1000, budget=16_000, steps=5_000)
    with pytest.raises(bounds.TemplateBound) as e:
        sandbox.render(template, CONVERSATION, None, {}, meter)
    assert str(e.value).startswith(says), str(e.value)


@pytest.mark.parametrize("template", [CHATML, LLAMA3, MARKED["bpe"], MARKED["byte_level"], PARTS, QWEN25])
@pytest.mark.parametrize("prompt", [False, True])
def test_a_template_within_its_bounds_renders_as_transformers_renders_it(template, prompt):
    from transformers.utils.chat_template_utils import render_jinja_template

    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    conversation = [*CONVERSATION, {"role": "user", "content": "And 2 \u00d7 5?"},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"type": "function", "function": {"name": "add", "arguments": {"a": 2}}}]}]
    conversation = conversation if template is QWEN25 else conversation[:3]
    variables = {"bos_token": "<s>", "eos_token": "</s>"}
    for given in (tools, None):
        theirs = render_jinja_template(conversations=[conversation], tools=given, chat_template=template,
                                       add_generation_prompt=prompt, return_assistant_tokens_mask=True, **variables)
        ours = sandbox.render(template, [{k: v for k, v in m.items() if v is not None} for m in conversation], given,
                              variables, bounds.Meter.for_input(100), prompt=prompt, marked=True)
        assert ours == (theirs[0][0], [tuple(span) for span in theirs[1][0]])


@pytest.mark.slow  # one torchrun launch of two processes
def test_a_hostile_template_is_the_same_line_on_every_rank(good, tmp_path):
    from tests.several_runs import several

    folder = hostile.template_folder(good, "nested-ranges", tmp_path)
    ranks = several({"loops": [RECIPE, f"model.config.pretrained_model_name_or_path={folder}",
                               f"run_dir={tmp_path / 'run'}", *SHORT]}, tmp_path)
    errors = [rank["loops"]["error"] for rank in ranks]
    assert errors[0] == errors[1] and errors[0].startswith(
        f"UserError: {folder / 'chat_template.jinja'}: rendering a conversation of two messages at start, the chat "
        f"template ran more than 1,000,032 steps"), errors


def branches(count: int) -> str:
    """A loop of `count` branches each setting a name of its own: Jinja's code generation for it grows with the
    square of `count` (1 MiB of it compiled for more than 18 minutes)."""
    return ("{% for message in messages %}" + "".join(f"{{% if a{i} %}}{{% set b{i} = 1 %}}{{% endif %}}"
                                                      for i in range(count)) + "{% endfor %}" + CHATML)


@pytest.mark.parametrize("count", [25_000, 4_000])  # 1.1 MB: refused before it is parsed; 170 KB, 20,000 nodes:
def test_a_template_too_large_to_compile_in_bounded_time_is_one_line(tmp_path, count):  # before its code is made
    folder = tokenizer_folder(tmp_path)
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    template = branches(count)
    with pytest.raises(UserError) as e:
        TextDataset(str(folder), str(path), chat_template=template, cache=None)
    says = (f"is {len(template):,} characters, more than the 262,144" if count > 5_000 else
            "is 20,022 expressions and statements, more than the 10,000")
    assert str(e.value) == (f"the recipe's chat_template: the chat template cannot be compiled within bounds: it "
                            f"{says} a chat template may have")


@pytest.mark.slow  # over 3 s on a quiet machine: left out of the fast tier (-m 'not slow')
def test_the_largest_templates_within_bounds_compile():
    sandbox.compiled(branches(1_900) + QWEN25)  # ~9,700 nodes: about 2 s of CPU


@pytest.mark.parametrize("template, says", [
    # textwrap cuts a long word a line at a time, copying the rest each time
    ("{{ ('a' * 500000) | wordwrap(1) }}", "read more than 16,790,016 characters in all"),
    # urlize searches a word ending in ')' from each of its characters: minutes
    ("{{ (')' * 100000 ~ 'a)') | urlize }}", "read more than 16,790,016 characters in all"),
    # each call linear, 100,000 of them on a value of a million characters: hours
    ("{% set x = 'a<b>' * 250000 %}{% for i in range(100000) %}{{ x | striptags | length }}{% endfor %}",
     "read more than 16,790,016 characters in all"),
    ("{% set x = 'a' * 1000000 %}{% for i in range(100000) %}{{ x.count('b') }}{% endfor %}",
     "read more than 16,790,016 characters in all"),
    # a table of 98 references to one string: 600 MB made before its size was measured
    ("{% set t = ['b' * 10000] * 98 %}{{ ('a' * 60000).translate(t) }}",
     "would make a translated string of 600,000,000 characters"),
    # punycode's encoder is Python's, quadratic: minutes
    ("{{ ('\u00e4' * 100000).encode('punycode') }}", "would encode with 'punycode', a codec whose time may grow"),
])
def test_each_filter_and_method_is_metered_by_its_inputs_size(template, says):
    """Bounds of a row of 100 characters (a value of 1,049,376 characters, 16,790,016 made and read in all): each
    of these took minutes or more in one call or one loop, each now refused before it runs long."""
    with pytest.raises(bounds.TemplateBound) as e:
        sandbox.render(template, CONVERSATION, None, {}, bounds.Meter.for_input(100))
    assert str(e.value).startswith(says), str(e.value)


def test_filters_on_ordinary_text_read_within_their_bounds():
    text = "See https://example.com/docs (and www.example.org). " * 40 + "a-long-hyphenated-word " * 40
    rendered = sandbox.render("{{ x | urlize }}|{{ x | wordwrap(30) }}|{{ ('<b>' ~ x ~ '</b>') | striptags }}",
                              CONVERSATION, None, {"x": text}, bounds.Meter.for_input(len(text)))[0]
    assert rendered.count('<a href="https://example.com/docs"') == 40 and rendered.endswith(text.strip())
