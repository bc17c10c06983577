"""Distilled draft models (DistillSpec, Zhou et al. 2024, arXiv:2310.08461): an independent small
causal LM with the target's tokenizer, trained so that its next-token distribution q agrees with
the target's p. Speculative sampling accepts a draft token with probability sum_x min(p, q) =
1 - TVD(p, q), so the divergence trained on (FKL, RKL, JSD(beta), TVD; train/losses.py) matters.

The student comes from (`init`):
- `truncate` (default): the target's own embeddings, final norm, lm_head and `num_layers` of its
  decoder layers (the first N, or N evenly spaced ones), so it starts close to the target;
- a folder or hub id of a smaller model with the *same tokenizer* (checked token by token).

The student is served as a plain causal LM (vLLM `draft_model`, SGLang STANDALONE, transformers
`generate(assistant_model=...)`); `draftsmith export --format hf` writes it with the tokenizer.
Training reads the target's `last_hidden` (cacheable like every feature) and applies the target's
lm_head to it: position p's teacher distribution is the target's over token p+1, the same offset
as the student's own logits at p.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from draftsmith import DraftsmithError
from draftsmith.eval.tree import Draft
from draftsmith.models.common import crop_cache, frozen_target, single_group
from draftsmith.train.losses import DIVERGENCES, expected_acceptance

NAME = "distill"


@dataclass
class DrafterConfig:
    init: str = "truncate"
    """`truncate` (layers of the target) or a folder / hub id of a smaller model with the target's tokenizer."""
    num_layers: int = 4
    """truncate: decoder layers the student keeps."""
    layers: str = "spaced"
    """truncate: `spaced` (N evenly spaced layers, the first and last included) or `first` (layers 0..N-1)."""
    divergence: str = "fkl"
    """fkl, rkl, jsd or tvd (train/losses.py), over the full vocabulary at every trained position."""
    temperature: float = 1.0
    """Both distributions are softened at this temperature before the divergence."""
    beta: float = 0.5
    """JSD(beta) mixture weight, 0 < beta < 1."""

    def __post_init__(self):
        if self.divergence not in DIVERGENCES:
            raise DraftsmithError(f"drafter.divergence: unknown '{self.divergence}' (valid: {', '.join(DIVERGENCES)})")
        if self.layers not in ("spaced", "first"):
            raise DraftsmithError(f"drafter.layers: expected spaced or first, got {self.layers!r}")
        if self.num_layers < 1 or self.temperature <= 0 or not 0 < self.beta < 1:
            raise DraftsmithError(f"drafter: expected num_layers >= 1, temperature > 0 and 0 < beta < 1, got "
                                  f"{self.num_layers}, {self.temperature}, {self.beta}")


def feature_names(cfg: DrafterConfig, target_config) -> tuple[str, ...]:
    return ("last_hidden",)  # the target's lm_head input: its logits, H numbers per token to cache


def max_draft_depth(cfg: DrafterConfig) -> int | None:
    return None  # an autoregressive student drafts as deep as asked


def kept_layers(cfg: DrafterConfig, n_target: int) -> list[int]:
    """Which target decoder layers a truncated student keeps, in order."""
    if cfg.num_layers > n_target:
        raise DraftsmithError(f"drafter.num_layers: {cfg.num_layers} is more than the target's {n_target} layers")
    if cfg.layers == "first" or cfg.num_layers == 1:
        return list(range(cfg.num_layers))
    return [round(i * (n_target - 1) / (cfg.num_layers - 1)) for i in range(cfg.num_layers)]


def truncated_student(target, cfg: DrafterConfig):
    """A copy of the target with only `kept_layers` decoder layers: embeddings, norm and lm_head are
    the target's, so a student that keeps every layer *is* the target."""
    keep = kept_layers(cfg, target.config.num_hidden_layers)
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = len(keep)
    if getattr(config, "layer_types", None):  # per-layer attention kinds (sliding/full) follow their layers
        config.layer_types = [config.layer_types[i] for i in keep]
    student = type(target)(config).to(next(target.parameters()).dtype)
    state = {}
    for name, tensor in target.state_dict().items():
        parts = name.split(".")
        if "layers" in parts:  # model.layers.{i}.* -> model.layers.{keep.index(i)}.*
            at = parts.index("layers") + 1
            if int(parts[at]) not in keep:
                continue
            parts[at] = str(keep.index(int(parts[at])))
        state[".".join(parts)] = tensor
    student.load_state_dict(state, strict=True)
    return student


def check_tokenizer(student_path: str, target) -> None:
    """The student must read and write the target's token ids: same vocabulary and special tokens."""
    mine = AutoTokenizer.from_pretrained(student_path)
    theirs = AutoTokenizer.from_pretrained(target.config._name_or_path)
    a, b = mine.get_vocab(), theirs.get_vocab()
    diff = next((t for t in sorted(set(a) | set(b), key=lambda t: b.get(t, a.get(t))) if a.get(t) != b.get(t)), None)
    if diff is not None:
        raise DraftsmithError(f"drafter.init {student_path}: tokenizer differs from the target's: token {diff!r} is id "
                              f"{a.get(diff)} in the student and {b.get(diff)} in the target")
    for attr in ("bos_token", "eos_token", "pad_token", "unk_token"):
        if getattr(mine, attr) != getattr(theirs, attr):
            raise DraftsmithError(f"drafter.init {student_path}: {attr} is {getattr(mine, attr)!r} in the student and "
                                  f"{getattr(theirs, attr)!r} in the target")


def build(cfg: DrafterConfig, target, dataset=None):
    if cfg.init == "truncate":
        student = truncated_student(target, cfg)
    else:
        check_tokenizer(cfg.init, target)
        student = AutoModelForCausalLM.from_pretrained(cfg.init, dtype=next(target.parameters()).dtype)
    return student.train().requires_grad_(True)


def rebuild(meta: dict, target):
    cfg = DrafterConfig(**{k: v for k, v in meta["drafter_config"].items() if k != "type"})
    return build(cfg, target)


# The student is one module trained at optim.lr, and the target stays frozen.
param_groups, verifier = single_group, frozen_target


def compute_loss(student, target, batch: dict, feats: dict, cfg: DrafterConfig, step: int = 0):
    """Returns (loss_sum, n_tokens, metric_sums).

    batch: input_ids, attention_mask, loss_mask [B, T]; feats["last_hidden"]: the target's [B, T, H].
    Logits at position p (student's and target's alike) predict token p+1, so the trained rows are
    the positions p whose next token p+1 is in the loss mask.
    """
    ids, lmask = batch["input_ids"], batch["loss_mask"].bool()
    rows = lmask[:, 1:].nonzero(as_tuple=True)
    with torch.no_grad():
        last = feats["last_hidden"]
        teacher = target.get_output_embeddings()(last[rows].to(target.dtype)).float()
    logits = student(input_ids=ids, attention_mask=batch.get("attention_mask")).logits[rows]
    mask = torch.ones(len(teacher), device=ids.device)
    kwargs = {"beta": cfg.beta} if cfg.divergence == "jsd" else {}
    loss = DIVERGENCES[cfg.divergence](logits, teacher, mask, temperature=cfg.temperature, **kwargs)
    with torch.no_grad():
        metrics = {"acc": (logits.argmax(-1) == teacher.argmax(-1)).float().sum(),
                   # 1 - TVD at temperature 1: the expected acceptance of a sampled draft token
                   "accept": expected_acceptance(logits.detach(), teacher, mask)}
    return loss, mask.sum(), metrics


class StudentProposer:
    """Chain drafting with the student's own KV cache. Each round the cache keeps the longest prefix
    of what it was fed that the accepted tokens still agree with; the rest is fed in one pass."""

    feature_names = ()  # the student reads tokens only

    def __init__(self, student):
        self.student = student.eval()
        self.reset()

    def reset(self):
        self.cache, self.fed = DynamicCache(), []

    def _feed(self, ids: list[int], device) -> torch.Tensor:
        out = self.student(input_ids=torch.tensor([ids], device=device), cache=self.cache, use_cache=True)
        self.fed += ids
        return out.logits[0, -1]

    @torch.no_grad()
    def propose(self, tokens: torch.Tensor, feats: dict, k: int, sampler=None) -> Draft:
        ids, device = tokens[0].tolist(), tokens.device
        same = next((i for i, (a, b) in enumerate(zip(self.fed, ids)) if a != b), min(len(self.fed), len(ids)))
        same = min(same, len(ids) - 1)  # feed at least the newest token: its logits start the draft
        crop_cache(self.cache, same)
        self.fed = self.fed[:same]
        logits, draft = self._feed(ids[same:], device), Draft()
        for i in range(k):
            q = None if sampler is None else sampler.probs(logits)
            token = int(logits.argmax()) if q is None else sampler.sample(q)
            draft.add(token, i - 1, q)
            if i + 1 < k:
                logits = self._feed([token], device)
        return draft


def make_proposer(student, target, cfg: DrafterConfig) -> StudentProposer:
    return StudentProposer(student)
