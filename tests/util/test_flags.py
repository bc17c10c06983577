"""draftsmith/util/flags.py: a dataclass's fields become a command's flags, help from their docstrings."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

import pytest

from draftsmith.eval.config import EvalConfig
from draftsmith.util import flags
from draftsmith.util.precision import dtype_arg


@dataclass(kw_only=True)
class Example:
    source: str = field(metadata={"positional": True})
    """where to read from"""
    extra: list[str] = field(default_factory=list, metadata={"positional": True})
    max_new_tokens: int = 3
    """tokens to write,
    at most (a docstring over two lines is one help line)"""
    ratio: float = 0.0
    out: str
    """a required flag: it has no default"""
    note: str | None = None
    verbose: bool = False
    """say more"""
    tag: list[str] = field(default_factory=list)
    """repeat for several"""
    engine: str = field(default="hf", metadata={"choices": ["hf", "vllm"]})
    dtype: str = field(default="auto", metadata={"type": dtype_arg, "help": "the precision"})


def _parser(cls: type) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="t")
    flags.add_flags(parser, cls)
    return parser


def _action(parser: argparse.ArgumentParser, dest: str) -> argparse.Action:
    return next(a for a in parser._actions if a.dest == dest)


def test_names_types_defaults_and_docstring_help():
    parser = _parser(Example)
    tokens = _action(parser, "max_new_tokens")
    assert tokens.option_strings == ["--max-new-tokens"] and tokens.type is int and tokens.default == 3
    assert tokens.help == "tokens to write, at most (a docstring over two lines is one help line) (default: 3)"
    assert _action(parser, "ratio").help == "(default: 0.0)"  # no docstring: the default alone
    assert _action(parser, "note").help is None and _action(parser, "out").help == "a required flag: it has no default"
    assert _action(parser, "dtype").help == "the precision (default: auto)"  # a shared help string, from metadata
    args = flags.parsed(Example, parser.parse_args(["in.jsonl", "--out", "o", "--max-new-tokens", "7"]))
    assert args == Example(source="in.jsonl", out="o", max_new_tokens=7)
    assert args.ratio == 0.0 and args.note is None and args.extra == [] and args.tag == []


def test_bool_is_a_switch_and_list_repeats():
    parser = _parser(Example)
    ns = parser.parse_args(["in", "a=1", "b=2", "--out", "o", "--verbose", "--tag", "x", "--tag=y"])
    assert ns.verbose is True and ns.tag == ["x", "y"] and ns.extra == ["a=1", "b=2"]
    assert _action(parser, "verbose").help == "say more"


def test_required_choices_and_a_custom_type_are_argparse_errors(capsys):
    parser = _parser(Example)
    for argv, message in [
        (["in"], "the following arguments are required: --out"),
        (["in", "--out", "o", "--engine", "tgi"], "invalid choice: 'tgi'"),
        (["in", "--out", "o", "--dtype", "int8"], "unknown precision 'int8'"),
    ]:
        with pytest.raises(SystemExit) as e:
            parser.parse_args(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err
    assert parser.parse_args(["in", "--out", "o", "--dtype", "bf16"]).dtype == "bfloat16"


def test_mirrored_flags_take_evalconfigs_defaults_and_help():
    """eval and compare take the eval stage's defaults and help from EvalConfig (written once)."""
    from draftsmith.eval.args import CompareArgs, EvalArgs

    real = EvalConfig()
    docs = flags.field_docs(EvalConfig)
    for cls in (EvalArgs, CompareArgs):
        parser = _parser(cls)
        for f in dataclasses.fields(cls):
            if "mirrors" in f.metadata:
                action = _action(parser, f.name)
                assert action.default == getattr(real, f.name), (cls.__name__, f.name)
                own = flags.field_docs(cls).get(f.name)  # an own docstring wins (e.g. compare's --tree)
                assert action.help.startswith(own or docs.get(f.name, "")), (cls.__name__, f.name)
    assert _action(_parser(EvalArgs), "k").help == docs["k"] + f" (default: {real.k})"


@dataclass(kw_only=True)
class Nested:
    mapping: dict = field(default_factory=dict)


@dataclass(kw_only=True)
class OnByDefault:
    fast: bool = True


@dataclass(kw_only=True)
class Misspelt:
    k: int = field(default=1, metadata={"choice": [1, 2]})


@dataclass(kw_only=True)
class TwoDefaults:
    k: int = field(default=3, metadata={"mirrors": EvalConfig})


@dataclass(kw_only=True)
class NoSuchField:
    beam: int = field(metadata={"mirrors": EvalConfig})


@pytest.mark.parametrize(
    "cls, message",
    [
        (Nested, "Nested.mapping: no flag for type"),
        (OnByDefault, "OnByDefault.fast: a switch is off unless given"),
        (Misspelt, "Misspelt.k: unknown metadata ['choice']"),
        (TwoDefaults, "TwoDefaults.k: mirrors EvalConfig, which gives its default"),
        (NoSuchField, "EvalConfig has no field 'beam'"),
    ],
)
def test_what_a_flag_cannot_express_fails_when_the_parser_is_built(cls, message):
    with pytest.raises(TypeError, match=message.replace("[", r"\[").replace("]", r"\]")):
        _parser(cls)
