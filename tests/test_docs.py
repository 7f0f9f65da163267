"""The docs describe what exists: README.md and docs/*.md checked against the tree and the console scripts.

* every markdown link to a local file resolves, and a ``#fragment`` names a heading of the file it points to
  (GitHub's anchor rule);
* every console-script subcommand the docs show in code (``autoglm-partition split``, ``autoglm-edge chat /
  serve``, ...) is one its parser has, and every ``--flag`` shown after it on the same code line (or its ``\\``
  continuations) is one of that subcommand's options;
* every ``from <package>.<module> import X`` in a doc's python blocks names a module and a name that exist;
* every module under the five packages is named in docs/architecture.md's module map, and every module path the
  docs name exists;
* every class (``FrontRuntime``), class member (``AsyncEngine.gather_max_s``) and snake_case name
  (``resolve_edge_quant``, an error code) docs/architecture.md cites in inline code is one the packages define or
  spell, and every other doc's ``Class.member`` of a class the packages define is one of its members.

Static and fast: the parsers are built in-process (the CLI modules import neither torch nor onnxruntime).
"""

from __future__ import annotations

import argparse
import ast
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
    for line in _code(doc.read_text().replace("\\\n", " ")):  # a command continued over `\` lines is one
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


# names architecture.md cites in code that the packages use but do not define: onnxruntime's contrib operator
EXTERNAL_CLASSES = frozenset({"MatMulNBits"})
CLASS_SPAN = re.compile(r"([A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*)(?:\.([A-Za-z_]\w*))?(?:\(.*\))?(?: -> .*)?")
SNAKE_SPAN = re.compile(r"([a-z_][a-z0-9]*_[a-z0-9_]*)(?:\(.*\))?")


def _package_names() -> tuple[dict[str, set[str]], set[str], set[str]]:
    """Over the five packages: class -> its members (methods, class-level fields, ``self.x`` assignments), every
    identifier in code, and every word of a string literal (error codes, registered names, docstrings)."""
    classes: dict[str, set[str]] = {}
    idents: set[str] = set()
    words: set[str] = set()
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            for n in ast.walk(ast.parse(path.read_text())):
                if isinstance(n, ast.ClassDef):
                    members = classes.setdefault(n.name, set())
                    for b in n.body:
                        if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)):
                            members.add(b.name)
                        elif isinstance(b, ast.AnnAssign) and isinstance(b.target, ast.Name):
                            members.add(b.target.id)
                        elif isinstance(b, ast.Assign):
                            members.update(t.id for t in b.targets if isinstance(t, ast.Name))
                    members.update(s.attr for s in ast.walk(n) if isinstance(s, ast.Attribute)
                                   and isinstance(s.ctx, ast.Store) and isinstance(s.value, ast.Name)
                                   and s.value.id == "self")
                elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    idents.add(n.name)
                elif isinstance(n, ast.Name):
                    idents.add(n.id)
                elif isinstance(n, ast.Attribute):
                    idents.add(n.attr)
                elif isinstance(n, ast.arg):
                    idents.add(n.arg)
                elif isinstance(n, ast.keyword) and n.arg:
                    idents.add(n.arg)
                elif isinstance(n, ast.Constant) and isinstance(n.value, str):
                    words.update(re.findall(r"\w+", n.value))
    return classes, idents, words


def test_architecture_cites_names_that_exist():
    classes, idents, words = _package_names()
    text = FENCE.sub("", (ROOT / "docs" / "architecture.md").read_text())
    bad = []
    for span in sorted(set(re.findall(r"`([^`\n]+)`", text))):
        if m := CLASS_SPAN.fullmatch(span):
            cls, member = m.groups()
            if cls in EXTERNAL_CLASSES:
                continue
            if cls not in classes:
                bad.append(f"{span}: no class {cls}")
            elif member and member not in classes[cls]:
                bad.append(f"{span}: {cls} has no {member}")
        elif (m := SNAKE_SPAN.fullmatch(span)) and m.group(1) not in idents | words:
            bad.append(f"{span}: no such name in the packages")
    assert not bad, "docs/architecture.md cites:\n" + "\n".join(bad)


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_members_cited_of_the_packages_classes_exist(doc: Path):
    """Every doc's inline ``Class.member`` of a class the packages define names a member it has (a renamed method
    left behind in prose, e.g. ``SplitTranslator.flush_steps``, is caught); other classes' names are not checked."""
    classes, _, _ = _package_names()
    bad = []
    for span in sorted(set(re.findall(r"`([^`\n]+)`", FENCE.sub("", doc.read_text())))):
        if (m := CLASS_SPAN.fullmatch(span)) and m.group(1) in classes and m.group(2) \
                and m.group(2) not in classes[m.group(1)]:
            bad.append(f"{span}: {m.group(1)} has no {m.group(2)}")
    assert not bad, f"{_doc_id(doc)} cites:\n" + "\n".join(bad)


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_named_module_paths_exist(doc: Path):
    text = doc.read_text()
    top = f"{ANY_PACKAGE}|bench|tests|scripts|deploy"
    paths = set(re.findall(rf"(?<![\w/.:-])((?:{top})/[\w/.-]*\w)(?![\w*])", text))
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"{_doc_id(doc)} names paths that do not exist: {missing}"


PY_FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
PY_IMPORT = re.compile(rf"^\s*(?:from ((?:{ANY_PACKAGE})(?:\.\w+)*) import ([\w ,]+)|import ((?:{ANY_PACKAGE})(?:\.\w+)*))",
                       re.M)


def _module_file(module: str) -> Path | None:
    path = ROOT / module.replace(".", "/")
    for file in (path / "__init__.py", path.with_suffix(".py")):
        if file.is_file():
            return file
    return None


def _defined_names(module: str) -> set[str]:
    """What ``from module import X`` can take: its top-level definitions, imports and lazy exports (a dict
    ``_EXPORTS`` of name -> module, as ``edge_client/__init__.py`` has), and a package's submodules."""
    file = _module_file(module)
    names: set[str] = set()
    for n in ast.parse(file.read_text()).body:
        if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(n.name)
        elif isinstance(n, (ast.Assign, ast.AnnAssign)):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
            if any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in targets) and isinstance(n.value, ast.Dict):
                names.update(k.value for k in n.value.keys if isinstance(k, ast.Constant))
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in n.names)
    if file.name == "__init__.py":
        names.update(p.stem for p in file.parent.glob("*.py"))
        names.update(p.name for p in file.parent.iterdir() if p.is_dir())
    return names


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_python_snippets_import_what_exists(doc: Path):
    """Every ``from <package>.<module> import X`` / ``import <package>.<module>`` in a doc's python blocks names a
    module and names the packages have (static: nothing is imported)."""
    bad = []
    for block in PY_FENCE.findall(doc.read_text()):
        for frm, names, plain in PY_IMPORT.findall(block):
            module = frm or plain
            if _module_file(module) is None:
                bad.append(f"{module}: no such module")
                continue
            missing = [x for x in re.split(r"[ ,]+", names.strip()) if x and x not in _defined_names(module)]
            bad += [f"from {module} import {x}: not defined there" for x in missing]
    assert not bad, f"{_doc_id(doc)}:\n" + "\n".join(bad)
