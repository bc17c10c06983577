"""A built-in corpus made from text that ships with every Python install, so the quickstart
needs no download.

- `code`: stdlib functions. Prompt = signature + docstring, completion = the function's source.
- `prose`: the language reference in `pydoc_data.topics`. Prompt = the topic, completion = its text.
- `summarise`: summarise a stdlib module's docstring; completion = the docstring's first sentence.
- `translate`: translate a sentence of the language reference into French, German or Spanish;
  completion = the sentence itself (a placeholder: train with `data.regenerate` to get the target's).
- `chat`: an open question about a stdlib module, as a user would ask it; completion = its docstring.

Train and holdout are split by *module* (or topic), never by line: about 1 in 8 top-level stdlib
modules is held out, so the holdout is a different slice of the domain.
"""

from __future__ import annotations

import ast
import functools
import re
import sysconfig
import textwrap
import zlib
from pathlib import Path

from draftsmith import DraftsmithError

HOLDOUT_EVERY = 8
KINDS = ("code", "prose", "summarise", "translate", "chat")
NAMES = tuple(n for k in KINDS for n in (k, f"{k}-holdout"))


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
        return lines[first].encode()[node.col_offset : node.end_col_offset].decode()
    head = lines[first].encode()[node.col_offset :].decode()  # col offsets count UTF-8 bytes
    return "".join([head, *lines[first + 1 : last], lines[last].encode()[: node.end_col_offset].decode()])


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
        rows.append(
            {
                "prompt": f"Explain the Python language topic '{key}'.",
                "completion": text[:2000],
                "source": f"pydoc_data.topics:{key}",
            }
        )
    return rows


def _module_docstrings(holdout: bool) -> list[tuple[str, str]]:
    """(module, docstring) of top-level stdlib modules with a docstring of a few sentences."""
    root, out = Path(sysconfig.get_paths()["stdlib"]), []
    for path in _stdlib_files():
        module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        if _is_holdout(module.split(".")[0]) != holdout:
            continue
        try:
            head = path.read_text(encoding="utf-8")[:4000]
        except UnicodeDecodeError:
            continue
        # The module docstring opens the file (after comments): read it without parsing the module.
        match = _DOCSTRING.match(head)
        if match and len(match.group(2)) >= 200:
            out.append((module, textwrap.dedent(match.group(2)).strip()[:1500]))
    return out


_DOCSTRING = re.compile(r'\A(?:\s*#[^\n]*\n|\s)*[rR]?("""|\'\'\')(.*?)\1', re.DOTALL)


def _first_sentence(text: str) -> str:
    return re.split(r"(?<=[.!?])\s", " ".join(text.split()), maxsplit=1)[0]


def summarise_records(holdout: bool) -> list[dict]:
    return [
        {
            "prompt": f"Summarise this description of the Python `{m}` module in two sentences.\n\n{doc}",
            "completion": _first_sentence(doc),
            "source": f"{m}:summary",
        }
        for m, doc in _module_docstrings(holdout)
    ]


def chat_records(holdout: bool) -> list[dict]:
    return [
        {
            "prompt": f"I keep seeing `import {m}` in Python code. What is it for, and when would I use it?",
            "completion": doc,
            "source": f"{m}:chat",
        }
        for m, doc in _module_docstrings(holdout)
    ]


def translate_records(holdout: bool) -> list[dict]:
    from pydoc_data.topics import topics

    rows, languages = [], ("French", "German", "Spanish")
    for key in sorted(topics):
        if _is_holdout(key) != holdout:
            continue
        # Prose paragraphs only: code and grammar blocks are indented, headings are underlined.
        paragraphs = [
            p for p in topics[key].split("\n\n") if p[:1].isalpha() and not set(p.splitlines()[-1]) <= set("*=-")
        ]
        sentences = [s for s in map(_first_sentence, paragraphs) if 40 <= len(s) <= 300][:3]
        for i, sentence in enumerate(sentences):
            language = languages[zlib.crc32(f"{key}{i}".encode()) % len(languages)]
            rows.append(
                {
                    "prompt": f"Translate into {language}: {sentence}",
                    "completion": sentence,
                    "source": f"pydoc_data.topics:{key}:translate{i}",
                }
            )
    return rows


def builtin_corpus(name: str) -> list[dict]:
    if name not in NAMES:
        raise DraftsmithError(
            f"builtin:{name}: unknown built-in corpus (choose from {', '.join('builtin:' + n for n in NAMES)})"
        )
    return [dict(r) for r in _built(name)]  # copies: the process keeps one build of each corpus


@functools.cache
def _built(name: str) -> tuple[dict, ...]:
    """A corpus, built once per process: `code` parses the whole stdlib (about 7 s on one core), and
    a run reads its data and holdout more than once (training, the eval's baseline and drafter)."""
    kind, _, split = name.partition("-")
    records = {
        "code": code_records,
        "prose": prose_records,
        "summarise": summarise_records,
        "translate": translate_records,
        "chat": chat_records,
    }[kind]
    rows = records(holdout=split == "holdout")
    # Deterministic order that interleaves modules, so `max_examples` keeps a varied subset.
    return tuple(sorted(rows, key=lambda r: zlib.crc32(r["source"].encode())))
