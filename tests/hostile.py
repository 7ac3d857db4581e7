"""Hostile model files for tests/test_hostile_weights.py: safetensors headers, indexes and config.json
that the safetensors library refuses, each a copy of a good folder's file with one thing wrong, so that
a reader that does not refuse it goes on to read, allocate or train (python -m tests.hostile FOLDER
writes them, to look at); chat templates that would take a machine's memory or time (templates, for
tests/test_text_templates.py); and the commands run on them, several in one process (run)."""

from __future__ import annotations

import json
import shutil
import struct
import sys
from pathlib import Path
from typing import Dict, Tuple

DEEP = 200_000  # nesting levels: Python's json gives up near 1,000 with a RecursionError


def read(path: Path) -> Tuple[dict, bytes]:
    """A safetensors file's header and its data section."""
    raw = path.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + size]), raw[8 + size:]


def write(path: Path, header, data: bytes = b"") -> Path:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def deep() -> bytes:
    return b'{"a": ' + b"[" * DEEP + b"]" * DEEP + b"}"


def many(entries: int = 1_500_000) -> bytes:
    """A header of `entries` 4-byte tensors all at the same 4 bytes: 66 bytes each (1.5 million:
    99 MB, under the library's cap of 100 MB)."""
    return b"{" + b",".join(b'"tensor.%07d":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}' % i
                            for i in range(entries)) + b"}"


def headers(good: Path, out: Path) -> Dict[str, Tuple[Path, Path, str]]:
    """Hostile .safetensors files made from `good` (a model's weights) in `out`: name -> (the file, the file
    the line about it names: the same, what that line says)."""
    out.mkdir(parents=True, exist_ok=True)
    header, data = read(good)
    names = [k for k in header if k != "__metadata__"]
    first, (a, b) = names[0], [n for n in names if n.endswith("q_proj.weight")][:2] or names[1:3]
    size = header[first]["data_offsets"][1] - header[first]["data_offsets"][0]

    def changed(name: str, **entry) -> dict:
        return {**header, name: {**header[name], **entry}}

    cases = {  # name: (header, data, what the line says)
        # the header's own bytes read as the first tensor's
        "negative-offsets": (changed(first, data_offsets=[-1024, size - 1024]), data, "expected usize"),
        # two tensors at the same bytes
        "overlapping-offsets": (changed(b, data_offsets=header[a]["data_offsets"]), data, "invalid offset"),
        # a tensor read from bytes after the data its neighbours tile
        "outside-the-data": (changed(first, data_offsets=[len(data), len(data) + size]), data + bytes(size),
                             "invalid offset"),
        "string-offsets": (changed(first, data_offsets=[str(x) for x in header[first]["data_offsets"]]), data,
                           "expected usize"),
        "float-offsets": (changed(first, data_offsets=[float(x) for x in header[first]["data_offsets"]]), data,
                          "expected usize"),
        "huge-shape": (changed(first, shape=[2 ** 70]), data, "expected usize"),
        "negative-shape": (changed(first, shape=[-1, -size // 4]), data, "expected usize"),
        "overflowing-shape": (changed(first, shape=[2 ** 40, 2 ** 40]), data, "overflow"),
        # consistent in itself (32 GiB of F32 at [0, 2**35]) in a file of 200 KB
        "32-GiB-tensor": ({first: {"dtype": "F32", "shape": [2 ** 33], "data_offsets": [0, 2 ** 35]}},
                          bytes(200_000), "not fully covered"),
        "deep-header": (deep(), data, "recursion limit"),
        "million-entries": (many(), b"\0" * 4, "has room for 1,500,000 tensors"),
    }
    return {name: (write(out / f"{name}.safetensors", h, d),) * 2 + (says,) for name, (h, d, says) in cases.items()}


def folders(good: Path, out: Path) -> Dict[str, Tuple[Path, Path, str]]:
    """Copies of the model folder `good` with a config.json or an index nested DEEP levels: name -> (the
    folder, the file the line about it names, what that line says)."""
    made = {}
    for name, file in (("deep-config", "config.json"), ("deep-index", "model.safetensors.index.json")):
        folder = out / name
        shutil.copytree(good, folder)
        if file.endswith("index.json"):
            (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
        (folder / file).write_bytes(deep())
        made[name] = (folder, folder / file, "nested deeper than Python's JSON parser goes")
    return made


# Chat templates that render a conversation in the sandbox transformers renders it in (jinja2's
# ImmutableSandboxedEnvironment) and would take a machine: name -> (the template, what the line about it says).
# Each comes before a working ChatML template, so that a template check that runs it meets it.
TEMPLATES = {
    "3-GB-string": ("{% set x = 'a' * 3000000000 %}", "would make a repeated value of 3,000,000,000 characters"),
    "terabyte-string": ("{{ 'a' * 10**12 }}", "would make a repeated value of 1,000,000,000,000 characters"),
    "nested-ranges": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                      "ran more than 1,000,032 steps"),
    "doubled-string": ("{% set ns = namespace(x='a') %}{% for i in range(64) %}{% set ns.x = ns.x ~ ns.x %}"
                       "{% endfor %}", "would make a joined string (~) of 2,097,152 characters"),
    "nested-lists": ("{% set ns = namespace(x=['a']) %}{% for i in range(64) %}{% set ns.x = [ns.x, ns.x] %}"
                     "{% endfor %}{{ ns.x }}", "would make a value of"),
    "centered": ("{{ 'a' | center(3000000000) }}", "would make a centered string of 3,000,000,000 characters"),
    "padded-format": ("{{ '%0999999999d' % 1 }}", "would make a formatted string of 1,000,000,011 characters"),
    "branching-macro": ("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}",
                        "ran more than 1,000,032 steps"),
    "kept-in-a-block": ("{% set ns = namespace(x='a' * 1000000) %}{% set y %}{% for i in range(100000) %}{{ ns.x }}"
                        "{% endfor %}{% endset %}", "made more than 16,777,472 characters of values in all"),
    "huge-integer": ("{{ (2 ** 100) ** 100 }}", "would make an integer of more than 8,192 bits"),
}


def template_folder(good: Path, name: str, out: Path) -> Path:
    """A copy of the model folder `good` whose chat_template.jinja starts with TEMPLATES[name]'s."""
    folder = out / name
    shutil.copytree(good, folder)
    template = folder / "chat_template.jinja"
    template.write_text(TEMPLATES[name][0] + template.read_text())
    return folder


def run(jobs: list) -> None:
    """Each job, [command, *args] (launcher or launcher.export), through the command's main() in this
    process: a JSON line each with its exit code (1 where it raised: the traceback is in its stderr) and
    its stderr, then one with this process's peak resident memory in bytes."""
    import contextlib
    import io
    import re
    import traceback

    from launcher.cli import main as train
    from launcher.export import main as export

    for command, *args in jobs:
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = {"launcher": train, "launcher.export": export}[command](args)
            except SystemExit as e:
                code = e.code
            except Exception:  # a bug: the command would end with this traceback, exit 1
                traceback.print_exc()
                code = 1
        print(json.dumps({"args": args, "code": code, "stderr": err.getvalue()}), flush=True)
    # VmHWM: this process image's own peak. ru_maxrss keeps, across the exec, the peak of the process it was forked
    # from (Linux's exec_mmap): a pytest worker grown to 1 GB read as this process's peak.
    peak = int(re.search(r"^VmHWM:\s+(\d+) kB$", open("/proc/self/status").read(), re.M).group(1))
    print(json.dumps({"peak": peak * 1024}))


if __name__ == "__main__":
    if sys.argv[1] == "--run":  # python -m tests.hostile --run JOBS.json
        run(json.loads(Path(sys.argv[2]).read_text()))
        sys.exit(0)
    from recipes.components.hf_folder import write as good_folder

    target = Path(sys.argv[1])
    good_folder(str(target / "good"))
    for name, (path, _, _) in {**headers(target / "good" / "model.safetensors", target),
                            **folders(target / "good", target)}.items():
        print(name, path)
