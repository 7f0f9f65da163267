"""The docs describe what exists: README.md and docs/*.md checked against the tree and the console scripts.

* every markdown link to a local file resolves, and a ``#fragment`` names a heading of the file it points to
  (GitHub's anchor rule);
* every console-script subcommand the docs show in code (``autoglm-partition split``, ``autoglm-edge chat /
  serve``, ...) is one its parser has, and every ``--flag`` shown after it on the same code line is one of that
  subcommand's options;
* every module under the five packages is named in docs/architecture.md's module map, and every module path the
  docs name exists.

Static and fast: the parsers are built in-process (the CLI modules import neither torch nor onnxruntime).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PACKAGES = ("shared", "edge_client", "partition_tools", "cloud_server", "rig")
ANY_PACKAGE = "|".join(PACKAGES)
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
COMMAND = re.compile(r"(?<![\w/.-])autoglm-(partition|cloud|edge|rig)[ \t]+([a-z][a-z-]*)((?:[ \t]*/[ \t]*[a-z][a-z-]*)*)")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _doc_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _anchors(path: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        m = re.match(r"#{1,6} (.+)", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _code(text: str) -> list[str]:
    """The lines of the fenced blocks and the inline code spans of a markdown text."""
    blocks = [m.group(0) for m in FENCE.finditer(text)]
    spans = re.findall(r"`([^`\n]+)`", FENCE.sub("", text))
    return [line for block in blocks for line in block.splitlines()] + spans


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_local_links_resolve(doc: Path):
    bad = []
    for target in LINK.findall(FENCE.sub("", doc.read_text())):
        if re.match(r"[a-z]+:", target):  # http(s):, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading with that anchor in {dest.name}")
    assert not bad, f"{_doc_id(doc)}: broken links: {bad}"


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings}


def _keys_add_options() -> set[str]:
    """``autoglm-cloud keys`` parses its own arguments (``cloud_server.auth.keys_main``): read its help."""
    from cloud_server.auth import keys_main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        keys_main(["add", "--help"])
    return set(FLAG.findall(out.getvalue()))


@pytest.fixture(scope="module")
def commands() -> dict[str, dict[str, set[str]]]:
    """program -> subcommand -> its option strings."""
    from cloud_server.cli import build_parser as cloud
    from edge_client.cli import build_parser as edge
    from partition_tools.cli import build_parser as partition
    from rig.cli import build_parser as rig

    table = {name: {sub: _options(p) for sub, p in _subparsers(build()).items()}
             for name, build in (("partition", partition), ("cloud", cloud), ("edge", edge), ("rig", rig))}
    table["cloud"]["keys"] = _keys_add_options()
    return table


def test_the_parsers_have_subcommands(commands):
    assert {"split", "verify", "inspect", "plan", "draft-head"} <= set(commands["partition"])
    assert {"serve", "keys"} <= set(commands["cloud"])
    assert {"chat", "serve", "preload", "demo"} <= set(commands["edge"])
    assert {"run", "demo"} <= set(commands["rig"])


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_documented_commands_and_flags_exist(doc: Path, commands):
    bad = []
    for line in _code(doc.read_text()):
        for m in COMMAND.finditer(line):
            prog, first, more = m.groups()
            subs = [first, *re.findall(r"[a-z][a-z-]*", more)]
            for sub in subs:
                if sub not in commands[prog]:
                    bad.append(f"autoglm-{prog} {sub}: no such subcommand ({line.strip()})")
            if more or first not in commands[prog]:
                continue
            rest = line[m.end():].split(" #", 1)[0]  # flags up to a shell comment
            rest = re.split(r"(?<!\S)(?:&&|\||;|autoglm-)", rest, maxsplit=1)[0]  # ... and to the next command
            for flag in FLAG.findall(rest):
                if flag not in commands[prog][first]:
                    bad.append(f"autoglm-{prog} {first} has no {flag} ({line.strip()})")
    assert not bad, f"{_doc_id(doc)}:\n" + "\n".join(bad)


def _modules() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
                  if p.name != "__init__.py")


def _named_in_architecture() -> set[str]:
    """Module paths docs/architecture.md names: in full anywhere, or in a table row's first column as
    ``pkg/a.py``, ``b.py`` (b under a's folder), or a folder row (``cloud_server/fast/``) naming its files."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(rf"(?<![\w/])((?:{ANY_PACKAGE})/[\w/]+\.py)", text))
    for line in text.splitlines():
        if not line.startswith("| `"):
            continue
        first, _, rest = line[1:].partition("|")
        folder = None
        for item in re.findall(r"`([^`]+)`", first):
            if item.endswith("/"):
                folder = item
                named.update(folder + name for name in re.findall(r"`([\w]+\.py)`", rest))
            elif "/" in item:
                folder = item.rsplit("/", 1)[0] + "/"
            elif folder and item.endswith(".py"):
                named.add(folder + item)
    return named


def test_architecture_names_every_module():
    missing = [m for m in _modules() if m not in _named_in_architecture()]
    assert not missing, f"docs/architecture.md's module map lacks: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_named_module_paths_exist(doc: Path):
    text = doc.read_text()
    top = f"{ANY_PACKAGE}|bench|tests|scripts|deploy"
    paths = set(re.findall(rf"(?<![\w/.:-])((?:{top})/[\w/.-]*\w)(?![\w*])", text))
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"{_doc_id(doc)} names paths that do not exist: {missing}"
