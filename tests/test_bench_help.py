"""Every ``bench/`` script's ``--help``: exit 0, and a description that is whole sentences (the docstring's first
paragraph; its first line alone stops mid-sentence wherever the paragraph wraps); and every ``--flag`` the docs
write after ``bench/<name>.py`` is one its parser has."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from bench_support import BENCH
from test_docs import DOCS, FLAG, _doc_id

SCRIPTS = sorted(p.stem for p in BENCH.glob("*.py") if "ArgumentParser(" in p.read_text())

# One process runs every script's ``--help`` as ``python bench/<name>.py --help`` would (``__main__``, bench/
# first on sys.path): what they import (torch, ...) is loaded once, not 30 times. The first parser to print its
# help gives the description.
DRIVER = r"""
import argparse, contextlib, io, json, runpy, sys
bench, names = sys.argv[1], sys.argv[2:]
sys.path.insert(0, bench)
shown = []
print_help = argparse.ArgumentParser.print_help
def recording(self, file=None):
    shown.append(self.description)
    return print_help(self, file)
argparse.ArgumentParser.print_help = recording
results = {}
for name in names:
    shown.clear()
    sys.argv = [f"{bench}/{name}.py", "--help"]
    out, code = io.StringIO(), None
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:
        code = e.code
    except BaseException as e:
        code = repr(e)
    results[name] = {"code": code, "help": out.getvalue(), "description": shown[0] if shown else None}
sys.stdout.write(json.dumps(results))
"""

SENTENCE_END = re.compile(r"[.?!][)\"'`]*$")


@pytest.fixture(scope="module")
def helps() -> dict:
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(BENCH), *SCRIPTS], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_the_scripts_are_found():
    assert len(SCRIPTS) >= 30 and "load_bench" in SCRIPTS and "results_io" not in SCRIPTS


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_exits_0_with_a_whole_sentence(helps, name):
    result = helps[name]
    assert result["code"] in (0, None) and result["help"].startswith("usage:"), result
    description = (result["description"] or "").strip()
    assert SENTENCE_END.search(description), f"{name}: description ends mid-sentence: ...{description[-80:]!r}"


@pytest.mark.parametrize("text, whole", [
    ("Fuzz the wire: the frame decoder and the session state", False),
    ("int8 and int4 edges:", False),
    ("    python bench/sampler_bench.py --rows 64 --out /tmp/sampler.json", False),
    ("Are the channels the same? (SmolLM2, layers [0, 8), torch.)", True),
    ("Is the split identical to the unsplit model's?", True),
])
def test_the_sentence_rule(text, whole):
    assert bool(SENTENCE_END.search(text)) is whole


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_documented_bench_commands_use_flags_their_scripts_have(helps, doc):
    """``python bench/<name>.py --flag ...`` in a doc (a command continued over ``\\`` lines read as one line): each
    flag up to the next command or shell separator is in the script's ``--help``."""
    bad = []
    for line in doc.read_text().replace("\\\n", " ").splitlines():
        for m in re.finditer(r"bench/(\w+)\.py", line):
            if m.group(1) not in helps:  # a helper, or no parser
                continue
            rest = re.split(r"`|&&|\||;|bench/|autoglm-|python", line[m.end():], maxsplit=1)[0]
            have = set(FLAG.findall(helps[m.group(1)]["help"]))
            bad += [f"{m.group(1)} {f}: {line.strip()[:120]}" for f in FLAG.findall(rest) if f not in have]
    assert not bad, f"{_doc_id(doc)} uses flags the scripts lack:\n" + "\n".join(bad)
