"""The one resolver of drafter specs: what a user names on the command line (`none`, `ngram`,
`lookahead[:…]`, `hybrid:PATH`, `cascade:LOW,MID`, a layer-skip folder, a trained drafter folder,
`PATH@TREE`) -> the proposer the engine drafts with, the model that verifies, and the tree. `compare`
resolves every drafter through it, `eval` every spec that is not a trained folder on its own."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch

from draftsmith import DraftsmithError
from draftsmith.engine import selfspec
from draftsmith.engine.cascade import build_cascade, parse_cascade
from draftsmith.engine.lookahead import HybridProposer, LookaheadProposer
from draftsmith.engine.proposers import NgramProposer, Proposer
from draftsmith.models.registry import load_drafter, target_to_load_on


class Resolved(NamedTuple):
    label: str  # how reports name it, e.g. "eagle3 (run)", "hybrid (run)", "lookahead (W=5,N=3,G=3)"
    proposer: Proposer | None  # None: target-only decoding
    verifier: torch.nn.Module  # the target, or the backbone a drafter trained (Medusa-2)
    tree: str | None  # the `@TREE` of the spec
    k: int | None = None  # the `@k=N` of the spec: this drafter's own chain length (else the run's --k)


def make_baseline(name: str):
    """`none` (target-only decoding) or `ngram` (prompt lookup): no training, no checkpoint."""
    return NgramProposer() if name == "ngram" else None


def parse_drafter(spec: str) -> tuple[str, str | None]:
    """`PATH[@TREE]` -> (path, tree spec or None)."""
    path, _, tree = spec.partition("@")
    return path, tree or None


def chain_length(suffix: str, spec: str) -> int:
    """`k=N` -> N >= 1, or a one-line error naming the spec."""
    n = suffix.removeprefix("k=")
    if not n.isdigit() or int(n) < 1:
        raise DraftsmithError(f"--drafter {spec}: expected @k=N with N >= 1 (a chain of N drafts), got @{suffix}")
    return int(n)


def trained_folders(spec: str) -> list[str]:
    """The trained drafter folders a drafter spec names (to read their metadata before loading any model)."""
    path = parse_drafter(spec)[0]
    if path.startswith("hybrid:"):
        return trained_folders(path.removeprefix("hybrid:"))
    if path.startswith("cascade:"):
        return [p for level in parse_cascade(path.removeprefix("cascade:")) for p in trained_folders(level)]
    if path in ("none", "ngram") or path.split(":")[0] == "lookahead" or (Path(path) / selfspec.FILE).is_file():
        return []
    return [path]


def resolve(spec: str, target, allow_stale: bool = False) -> Resolved:
    """Every drafter a user can name -> Resolved(label, proposer, verifier, tree spec or None):
    - `none` (target-only), `ngram` (prompt lookup), `lookahead[:W=5,N=3,G=3]` (Jacobi window W,
      n-gram size N, G pool n-grams per round; draftsmith/engine/lookahead.py);
    - `hybrid:PATH`: prompt lookup when the context repeats itself, the trained drafter at PATH otherwise;
    - `cascade:LOW,MID`: LOW (`ngram` or a student folder) drafts for MID (a distilled student or a
      layer-skip folder), whose greedy continuation the target verifies (draftsmith/engine/cascade.py);
    - a layer-skip folder (`draftsmith layerskip`), or a trained drafter folder, `PATH@TREE` for a tree;
    - any of them `@k=N`: chains of N drafts for this drafter (a drafter with its own best length, or
      one that drafts fewer tokens per round than the run's --k, beside the others in one `compare`).
    The verifier is the target, except for a drafter that trained its backbone (Medusa-2)."""
    path, tree = parse_drafter(spec)
    if tree is not None and tree.startswith("k="):  # `SPEC@k=N`: a chain of N, whatever the run's --k
        return resolve(path, target, allow_stale)._replace(tree=None, k=chain_length(tree, spec))
    if path in ("none", "ngram"):
        return Resolved(path, make_baseline(path), target, tree)
    if path.split(":")[0] == "lookahead":  # `lookahead` or `lookahead:W=5,N=3,G=3`
        proposer = LookaheadProposer.from_spec(path)
        return Resolved(proposer.spec(), proposer, target, None)
    if path.startswith("hybrid:"):
        inner = path.removeprefix("hybrid:")
        own = resolve(inner + (f"@{tree}" if tree else ""), target, allow_stale)
        return Resolved(
            f"hybrid ({Path(inner).parent.name or inner})",
            HybridProposer(NgramProposer(), own.proposer),
            own.verifier,
            own.tree,
        )
    if path.startswith("cascade:"):
        names = parse_cascade(path.removeprefix("cascade:"))
        levels = [NgramProposer() if n == "ngram" else resolve(n, target, allow_stale)[1] for n in names]
        return Resolved(
            f"cascade ({', '.join(Path(n).parent.name if Path(n).name == 'final' else Path(n).name for n in names)})",
            build_cascade(levels, names, target),
            target,
            None,
        )
    if (Path(path) / selfspec.FILE).is_file():  # a training-free layer-skip choice
        return Resolved(f"layerskip ({Path(path).name})", selfspec.load(path, target), target, None)
    own = target_to_load_on(target, path)
    family, dcfg, drafter = load_drafter(path, own, allow_stale)
    verifier = family.verifier(drafter, own)
    return Resolved(
        f"{family.NAME} ({Path(path).parent.name or path})",
        family.make_proposer(drafter, verifier, dcfg),
        verifier,
        tree,
    )
