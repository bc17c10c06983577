"""Command-line flags generated from a dataclass: one field, one flag, its docstring the help.

A field `foo_bar: int = 3` with a string literal right after it (as train/config.py documents its
fields) becomes `--foo-bar`, type int, default 3, that string and "(default: 3)" as its help. The CLI (draftsmith/cli.py)
builds every command's parser this way, so a flag's default and meaning are written once.

- A field without a default is a required flag; `bool` is a switch (store_true, defaults to False);
  `list[str]` repeats (`--x a --x b`, argparse's append), or takes zero or more words when positional.
- `field(metadata={...})` says what a type cannot:
    positional: True         an argument, not a flag
    choices: [...]           the accepted values
    type: callable           parses the word instead of the annotation (e.g. util/precision.py dtype_arg)
    help: str                help shared by several commands (a constant) instead of a docstring
    mirrors: Class           default and help of the dataclass Class's field of the same name (an own
                             docstring wins), e.g. eval/config.py EvalConfig: written once.
- Any other type, or metadata key, is a TypeError when the parser is built (a test builds every one).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import textwrap
import types
import typing
from typing import Any

KEYS = {"positional", "choices", "type", "help", "mirrors"}
SCALARS = (str, int, float)
MISSING = dataclasses.MISSING


def _documented(body: list[ast.stmt]) -> dict[str, tuple[ast.expr | None, str]]:
    """Each annotated field of a class body -> (its default expression, the string literal after it)."""
    found = {}
    for node, after in zip(body, [*body[1:], None]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            value = after.value if isinstance(after, ast.Expr) else None
            doc = value.value if isinstance(value, ast.Constant) and isinstance(value.value, str) else ""
            found[node.target.id] = (node.value, " ".join(inspect.cleandoc(doc).split()))
    return found


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Field name -> its docstring, for `cls` and the dataclasses it inherits from."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass) and "__dataclass_fields__" in vars(klass):
            node = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0]
            assert isinstance(node, ast.ClassDef)  # the source of a class is its class statement
            docs.update((name, doc) for name, (_, doc) in _documented(node.body).items() if doc)
    return docs


def mirrored(cls: type, name: str) -> tuple[Any, str]:
    """The default and docstring of the dataclass `cls`'s field `name`."""
    found = {f.name: f for f in dataclasses.fields(cls)}
    if name not in found or _default(found[name]) is MISSING:
        raise TypeError(f"flags: {cls.__name__} has no field {name!r} with a default to mirror")
    return _default(found[name]), field_docs(cls).get(name, "")


def _base(tp: Any, where: str) -> tuple[type, bool]:
    """(the scalar type, whether the flag repeats) of an annotation; `X | None` is X."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(tp) if a is not type(None)]
        tp = rest[0] if len(rest) == 1 else tp
    if tp is bool or tp in SCALARS:
        return tp, False
    if typing.get_origin(tp) is list and typing.get_args(tp)[0] in SCALARS:
        return typing.get_args(tp)[0], True
    raise TypeError(f"flags: {where}: no flag for type {tp!r} (str, int, float, bool, list[str], or X | None)")


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not MISSING else f.default


def _options(f: dataclasses.Field, tp: Any, doc: str, where: str) -> dict[str, Any]:
    """add_argument's keyword arguments for one field."""
    meta = dict(f.metadata)
    if set(meta) - KEYS:
        raise TypeError(f"flags: {where}: unknown metadata {sorted(set(meta) - KEYS)} (known: {sorted(KEYS)})")
    default, help_ = _default(f), meta.get("help") or doc
    if "mirrors" in meta:
        if default is not MISSING:
            raise TypeError(
                f"flags: {where}: mirrors {meta['mirrors'].__name__}, which gives its default; drop its own"
            )
        default, theirs = mirrored(meta["mirrors"], f.name)
        help_ = help_ or theirs
    base, repeats = _base(tp, where)
    # isinstance, not `in (False,)`: 0 == False, and a default of 0 is worth showing
    shown = default is not MISSING and default not in (None, []) and not isinstance(default, bool)
    if shown and "default" not in help_:
        help_ = f"{help_} (default: {default})".lstrip()
    kw: dict[str, Any] = {"help": help_.replace("%", "%%")} if help_ else {}  # argparse %-formats help
    if base is bool:
        if default is not False:
            raise TypeError(f"flags: {where}: a switch is off unless given, so its default must be False")
        return {**kw, "action": "store_true"}
    kw["type"] = meta.get("type", base)
    if "choices" in meta:
        kw["choices"] = meta["choices"]
    if meta.get("positional"):
        if repeats:  # zero or more words; argparse gives [] for none
            return {**kw, "nargs": "*"}
        if default is not MISSING:
            raise TypeError(f"flags: {where}: a positional argument is always given; drop its default")
        return kw
    if repeats:
        kw["action"] = "append"
    return {**kw, "required": True} if default is MISSING else {**kw, "default": default}


def add_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """One argument of `parser` per field of the dataclass `cls`, in field order."""
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    for f in dataclasses.fields(cls):
        kw = _options(f, hints[f.name], docs.get(f.name, ""), f"{cls.__name__}.{f.name}")
        names = [f.name] if f.metadata.get("positional") else ["--" + f.name.replace("_", "-")]
        parser.add_argument(*names, **kw)


def parsed(cls: type, namespace: argparse.Namespace) -> Any:
    """The dataclass `cls` holding what argparse parsed into `namespace`."""
    return cls(**{f.name: getattr(namespace, f.name) for f in dataclasses.fields(cls)})
