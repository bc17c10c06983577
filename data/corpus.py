"""A built-in corpus made from text that ships with every Python install, so the quickstart
needs no download.

- `code`: stdlib functions. Prompt = signature + docstring, completion = the function's source.
- `prose`: the language reference in `pydoc_data.topics`. Prompt = the topic, completion = its text.

Train and holdout are split by *module* (or topic), never by line: about 1 in 8 top-level stdlib
modules is held out, so the holdout is a different slice of the domain.
"""

from __future__ import annotations

import ast
import re
import sysconfig
import textwrap
import zlib
from pathlib import Path

from draftsmith import DraftsmithError

HOLDOUT_EVERY = 8
NAMES = ("code", "code-holdout", "prose", "prose-holdout")


def _is_holdout(group: str) -> bool:
    return zlib.crc32(group.encode()) % HOLDOUT_EVERY == 0


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "idlelib", "lib2to3", "site-packages", "ensurepip", "turtledemo", "tkinter", "pydoc_data"}
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in skip or any(p.startswith("test") for p in rel.parts):
            continue
        files.append(path)
    return files


def _lines(source: str) -> list[str]:
    """Split like ast.get_source_segment does (only \\r\\n, \\r and \\n end a line; form feeds do not)."""
    return re.findall(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+$", source)


def _segment(lines: list[str], node) -> str:
    """ast.get_source_segment(source, node) with the file split once: the stdlib helper re-splits the
    whole file on every call, which made reading the corpus take 80 s instead of 3."""
    first, last = node.lineno - 1, node.end_lineno - 1
    if first == last:
        return lines[first].encode()[node.col_offset:node.end_col_offset].decode()
    head = lines[first].encode()[node.col_offset:].decode()  # col offsets count UTF-8 bytes
    return "".join([head, *lines[first + 1:last], lines[last].encode()[:node.end_col_offset].decode()])


def _functions(path: Path, root: Path):
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (SyntaxError, UnicodeDecodeError):
        return
    lines = _lines(source)
    module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        body = _segment(lines, node)
        # Methods are indented; re-indent the first line so dedent gives clean top-level code.
        body = body and textwrap.dedent(" " * node.col_offset + body)
        if not doc or not body or not (4 <= body.count("\n") <= 40):
            continue
        yield module, node.name, ast.unparse(node.args), doc.strip(), body


def code_records(holdout: bool) -> list[dict]:
    root = Path(sysconfig.get_paths()["stdlib"])
    rows = []
    for path in _stdlib_files():
        # The split is by top-level module, known from the path: skip the other split unparsed.
        if _is_holdout(path.relative_to(root).with_suffix("").parts[0]) != holdout:
            continue
        for module, name, args, doc, body in _functions(path, root):
            first_para = doc.split("\n\n")[0]
            prompt = f"Write the Python function `{name}({args})` from the `{module}` module.\n{first_para}"
            rows.append({"prompt": prompt, "completion": f"```python\n{body}\n```", "source": f"{module}.{name}"})
    return rows


def prose_records(holdout: bool) -> list[dict]:
    from pydoc_data.topics import topics

    rows = []
    for key in sorted(topics):
        if _is_holdout(key) != holdout:
            continue
        text = topics[key].strip()
        rows.append({"prompt": f"Explain the Python language topic '{key}'.",
                     "completion": text[:2000], "source": f"pydoc_data.topics:{key}"})
    return rows


def builtin_corpus(name: str) -> list[dict]:
    if name not in NAMES:
        raise DraftsmithError(f"builtin:{name}: unknown built-in corpus (choose from {', '.join('builtin:' + n for n in NAMES)})")
    kind, _, split = name.partition("-")
    rows = (code_records if kind == "code" else prose_records)(holdout=split == "holdout")
    # Deterministic order that interleaves modules, so `max_examples` keeps a varied subset.
    return sorted(rows, key=lambda r: zlib.crc32(r["source"].encode()))
