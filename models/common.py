"""Functions every drafter family shares: masks, the standalone save/load format, small checks."""

from __future__ import annotations

import json
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import DynamicCache

from draftsmith import DraftsmithError
from draftsmith.models.drafts import Draft, grow_tree

FORMAT_VERSION = 2  # 2: every family config is saved with its defaults resolved (EAGLE-3 aux layers)


def causal_mask(q_len: int, kv_len: int, padding: torch.Tensor | None = None, device=None) -> torch.Tensor:
    """Boolean attention mask [B|1, 1, q_len, kv_len]; True = may attend.

    The q_len queries are the *last* q_len positions of the kv_len keys (a KV cache may hold
    kv_len - q_len earlier positions), so query i sits at absolute position kv_len - q_len + i.
    `padding` [B, kv_len] marks real (1) vs padded (0) keys.
    """
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    mask = (k_pos <= q_pos)[None, None]
    if padding is not None:
        mask = mask & padding[:, None, None, :].bool()
    # A fully padded query row would make softmax NaN; let it see itself (its loss is masked).
    eye = (k_pos == q_pos)[None, None]
    return mask | eye


def ttt_mask(t: int, step: int, padding: torch.Tensor) -> torch.Tensor:
    """Attention mask [B, 1, t, t*(step+1)] for unrolled step `step` of training-time test
    (EAGLE-3) and of HASS context alignment (EAGLE-1 with `hass: true`): the same unroll.

    Chains are indexed by their root r (the last position with a real target feature). Keys are
    the real pairs of step 0 (block 0: causal, r' <= r) and, for steps 1..step, only the chain's own
    earlier draft states (diagonal blocks). That is exactly what draft step `step` sees at
    inference: the real KV cache up to r plus its own previous drafts.
    """
    blocks = [causal_mask(t, t, padding, device=padding.device)]
    eye = torch.eye(t, dtype=torch.bool, device=padding.device)[None, None].expand(padding.shape[0], 1, t, t)
    blocks += [eye] * step
    return torch.cat(blocks, dim=-1)


def max_over_ranks(n: int, device: torch.device) -> int:
    """The largest n of all ranks when a process group runs (n itself in one process)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return n
    t = torch.tensor([n], device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return int(t.item())


def target_label_rows(lm_head, last: torch.Tensor, need: torch.Tensor, reduce):
    """The target's logits at the positions `need` [B, T] marks (some draft's label), computed in
    chunks of 4096 rows over the full vocabulary, one chunk alive at a time, each cut down by
    `reduce(logits [n, V]) -> tuple of tensors` -> (row_of [B, T]: position -> row or -1, [each
    reduced tensor over all rows]). A sharded target (ZeRO-3, FSDP) gathers lm_head on every call,
    on all ranks together: every rank makes as many calls as the rank with the most rows (extra
    ones on no rows)."""
    nb, np_ = need.nonzero(as_tuple=True)
    row_of = torch.full(need.shape, -1, dtype=torch.long, device=need.device)
    row_of[nb, np_] = torch.arange(len(nb), device=need.device)
    calls = max(max_over_ranks(-(-len(nb) // 4096), need.device), 1)  # one call on no rows: empty outputs
    parts = [
        reduce(lm_head(last[nb[c : c + 4096], np_[c : c + 4096]].to(lm_head.weight.dtype)).float())
        for c in range(0, 4096 * calls, 4096)
    ]
    return row_of, [torch.cat(p) for p in zip(*parts)]


def draft_vocab(dataset, vocab: int, size: int) -> torch.Tensor:
    """The `size` most frequent target tokens among loss-masked (trained) tokens, sorted by id: the
    reduced draft vocabulary of EAGLE-3 heads and Medusa heads (FR-Spec, Zhao et al. 2025).
    Ties and unseen tokens are filled by id order, so the choice is deterministic."""
    if size > vocab:
        raise DraftsmithError(f"drafter.draft_vocab_size: {size} is larger than the target vocabulary ({vocab})")
    counts = torch.zeros(vocab, dtype=torch.long)
    for ids, mask in zip(dataset["input_ids"], dataset["loss_mask"]):
        ids = torch.tensor(ids)[torch.tensor(mask, dtype=torch.bool)]
        counts += torch.bincount(ids, minlength=vocab)[:vocab]
    # Stable sort on -count keeps id order among ties.
    order = torch.sort(-counts, stable=True).indices[:size]
    return order.sort().values


def lora_config(cfg, model: torch.nn.Module):
    """peft LoraConfig from a family config's lora_rank / lora_alpha / lora_dropout / lora_target_modules
    (Medusa-2's backbone, a distilled student); names that are not linear layers of `model` fail with
    the ones that are."""
    from peft import LoraConfig

    out = model.get_output_embeddings()
    linear = sorted(
        {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not out}
    )
    wanted = [n.strip() for n in cfg.lora_target_modules.split(",") if n.strip()]
    if wanted != ["all-linear"]:
        unknown = [n for n in wanted if n not in linear]
        if unknown or not wanted:
            raise DraftsmithError(
                f"drafter.lora_target_modules: {', '.join(unknown) or 'nothing given'} not in the "
                f"model; its linear layers are {', '.join(linear)} (or use all-linear)"
            )
    return LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules="all-linear" if wanted == ["all-linear"] else wanted,
        bias="none",
    )


def single_group(drafter: torch.nn.Module, cfg, lr: float) -> list[dict]:
    """`param_groups` of a family that trains one module at one learning rate (optim.lr)."""
    return [{"name": "drafter", "params": [p for p in drafter.parameters() if p.requires_grad], "lr": lr}]


def mask_token(requested: int | None, target_config) -> int:
    """A block drafter's mask token (`drafter.mask_token_id`): the id asked for, else the target's pad
    token, else its eos (speculators' fallback for a tokenizer without a mask token or a spare row)."""
    mid = requested
    if mid is None:
        mid = target_config.pad_token_id if target_config.pad_token_id is not None else target_config.eos_token_id
        mid = mid[0] if isinstance(mid, list) else mid
    if not isinstance(mid, int) or not 0 <= mid < target_config.vocab_size:
        raise DraftsmithError(
            f"drafter.mask_token_id: expected an id in [0, {target_config.vocab_size - 1}] (the "
            f"target's vocabulary), got {mid}"
        )
    return mid


def keep_config(cfg, init_config: dict, target_config):
    """`from_init` of a family whose config does not depend on the drafter it starts from."""
    return cfg


def frozen_target(drafter: torch.nn.Module, target):
    """`verifier` of a family that leaves the target untouched: the target verifies the drafts."""
    return target


def vllm_method(method: str):
    """`vllm_serving` of a family vLLM serves as speculative `method` with a chain of k drafts and no
    extra server flags: -> (--speculative-config, flags)."""

    def vllm_serving(export_dir, export_config: dict, k: int) -> tuple[dict, list[str]]:
        return {"method": method, "model": str(export_dir), "num_speculative_tokens": k}, []

    return vllm_serving


def write_tensors(out: Path, config: dict, state: dict) -> None:
    """An export folder's files: `model.safetensors` (the dtype the weights were trained and evaluated
    in; engines cast on load) and `config.json`."""
    tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    save_file(tensors, Path(out) / "model.safetensors", metadata={"format": "pt"})
    (Path(out) / "config.json").write_text(json.dumps(config, indent=2))


def llama_dims(drafter) -> dict:
    """The one-layer Llama config of a feature-space head, with the target's RoPE: its theta and its
    scaling (Llama-3.1's `llama3`, YaRN, linear, ...), which the drafter trained with and the engine
    must rebuild. Written in both spellings: `rope_theta` + `rope_scaling` (SGLang, transformers 4)
    and `rope_parameters` (transformers 5, which vLLM 0.32 reads)."""
    c = drafter.config
    rope = dict(c.rope_parameters)
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    return {
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "hidden_act": "silu",
        "max_position_embeddings": c.max_position_embeddings,
        "rope_theta": rope.get("rope_theta"),
        "rope_scaling": None if scaling.get("rope_type", "default") == "default" else scaling,
        "rope_parameters": rope,
        "num_hidden_layers": 1,
        "vocab_size": c.vocab_size,
    }


def exported_layer_config(config: dict):
    """The head's layer config an engine rebuilds from an exported config.json alone (speculators
    nests it): what `from_exported_head` builds with, so `export --verify` catches a config that does
    not say what the weights were trained with."""
    from transformers import LlamaConfig

    dims = config.get("transformer_layer_config", config)
    # transformers 5 reads rope_theta + rope_scaling into rope_parameters, as the engines do
    keys = {k: v for k, v in dims.items() if k not in ("model_type", "rope_parameters", "architectures")}
    layer = LlamaConfig(**keys)
    layer._attn_implementation = "sdpa"
    return layer


def from_exported_head(drafter, config: dict, state: dict):
    """A freshly built feature-space head given what the exported config says for every part not
    fixed by weight shapes (load_state_dict checks those): rotary embeddings (RoPE type, theta,
    scaling) and norm epsilons; then the exported weights."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

    layer = exported_layer_config(config)
    for name, child in list(drafter.named_modules()):
        if isinstance(child, LlamaRotaryEmbedding):
            parent, _, attr = name.rpartition(".")
            setattr(drafter.get_submodule(parent) if parent else drafter, attr, LlamaRotaryEmbedding(layer))
        elif isinstance(child, LlamaRMSNorm):
            child.variance_epsilon = layer.rms_norm_eps
    drafter.config = layer
    drafter.load_state_dict(state, strict=True)
    return drafter


def renamed(state: dict, old: str, new: str) -> dict:
    """Tensor names with prefix `old` under prefix `new` (the engines' names <-> draftsmith's)."""
    return {(new + k[len(old) :]) if k.startswith(old) else k: v for k, v in state.items()}


def trains_target_never(drafter_config: dict) -> bool:
    """`trains_target` of a family that never changes the target's weights."""
    return False


def no_held_out_metrics(drafter, verifier, sequences) -> dict:
    """`held_out_metrics` of a family with nothing to add to the eval's figures (benchmarks)."""
    return {}


def no_consumer_check(exported, target, ours, prompt_ids) -> None:
    """`consumer_check` of a family whose formats' engine-side loaders draftsmith does not run."""
    return None


@contextmanager
def target_as_original(drafter, target):
    """`original` of a family that leaves the target untouched: the target is the original."""
    yield target


def vllm_snippet(method: str, repo_id: str, target: str, k: int) -> str:
    return (
        f"```bash\nvllm serve {target} --speculative-config \\\n"
        f'  \'{{"method": "{method}", "model": "{repo_id}", "num_speculative_tokens": {k}}}\'\n```'
    )


def logit_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """max |x - y| where equal entries count 0: a reduced draft vocabulary puts -inf on the tokens it
    cannot draft (EAGLE-3), and -inf - -inf would be nan."""
    return torch.where(x == y, 0.0, (x - y).abs()).max().item()


def layer_activation_bytes(hidden: int, intermediate: int, elem: int) -> int:
    """Bytes per token a decoder layer keeps for backward (flash/SDPA attention) in `elem`-byte activations."""
    return elem * (10 * hidden + 4 * intermediate)


def save_drafter(module: torch.nn.Module, out: Path, meta: dict, state: dict | None = None) -> Path:
    """Write `config.json` + `model.safetensors` to a temp folder, then rename into place. `state`:
    the module's full tensors when it holds shards (FSDP gathers them on rank 0)."""
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # Tied weights (a student's lm_head = its embeddings) are stored once, under their first name:
    # named_parameters() lists a shared parameter once.
    unique = {n for n, _ in module.named_parameters()} | {n for n, _ in module.named_buffers()}
    full = module.state_dict() if state is None else state
    state = {k: v.detach().to("cpu").contiguous() for k, v in full.items() if k in unique}
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps({"draftsmith_format": FORMAT_VERSION, **meta}, indent=2))
    if out.exists():
        shutil.rmtree(out)
    tmp.replace(out)
    return out


def read_drafter_meta(path: Path) -> dict:
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file() or not (path / "model.safetensors").is_file():
        raise DraftsmithError(f"{path}: not a draftsmith drafter folder (expected config.json and model.safetensors)")
    try:
        meta = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise DraftsmithError(f"{cfg_file}: invalid JSON ({e})") from None
    for key in ("drafter", "target", "target_fingerprint", "drafter_config"):
        if key not in meta:
            raise DraftsmithError(f"{cfg_file}: missing key '{key}'")
    return meta


def load_state(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(Path(path) / "model.safetensors")
    except Exception as e:  # safetensors raises several types for truncated files
        raise DraftsmithError(f"{path}/model.safetensors: cannot read weights ({e})") from None


def check_fingerprint(meta: dict, fp: str, where: str) -> None:
    if meta["target_fingerprint"] != fp:
        raise DraftsmithError(
            f"{where}: drafter was trained for target '{meta['target']}' (fingerprint {meta['target_fingerprint']}), "
            f"but the given target has fingerprint {fp}; retrain or fine-tune the drafter for this target "
            f"(init_from_stale=true starts that fine-tune from this drafter)"
        )


def crop_cache(cache, length: int) -> None:
    """Keep the first `length` positions of a transformers Cache (its `crop` takes a count to remove)."""
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


def keep_cache_positions(cache, prefix: int, positions: list[int]) -> None:
    """Keep the first `prefix` positions of a Cache plus the given later ones, in order: after tree
    verification, the accepted path. A contiguous path is a plain crop."""
    if positions == list(range(prefix, prefix + len(positions))):
        return crop_cache(cache, prefix + len(positions))
    index = torch.tensor(list(range(prefix)) + positions, device=cache.layers[0].keys.device)
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(-2, index)
        layer.values = layer.values.index_select(-2, index)


class FeatureProposer:
    """Chain and tree drafting for feature-space drafters (EAGLE-1, EAGLE-3), with the drafter's KV cache.

    The engine passes all tokens x_0..x_{n-1} and the target features of x_0..x_{n-2} (everything
    the target has verified). Pair i = (hidden from target features at i, token x_{i+1}) is *real*
    for i <= n-2 and stays cached across rounds. A draft node is fed as the pair (the drafter's own
    output at the node's parent, the node's token) at position n-2 + depth, attending to the real
    cache and its own fed ancestors only; draft pairs are cropped away before the next round, when
    real features replace them.

    to_hidden(feats) -> [1, t, H] drafter input from target features; step(hidden, embeds, pos,
    mask, cache) -> out [1, t, H]; logits(out [1, t, H]) -> [1, t, V] over the *target* vocabulary.
    With a `sampler` (temperature > 0), chain drafts are sampled and keep their distribution q for
    the rejection rule; otherwise drafts are the argmax (chains) or top-k expansions (trees).
    """

    def __init__(self, drafter, target, feature_names, to_hidden, step, logits):
        self.drafter = drafter.eval()
        self.feature_names = tuple(feature_names)
        self.embed = target.get_input_embeddings()
        self.to_hidden, self.step, self.logits = to_hidden, step, logits
        self.reset()

    def reset(self):
        self.cache, self.n_real = DynamicCache(), 0

    def _prefill(self, tokens: torch.Tensor, feats: dict) -> torch.Tensor:
        """Feed the real pairs not cached yet -> logits [V] for the first draft position."""
        crop_cache(self.cache, self.n_real)
        n_feats = next(iter(feats.values())).shape[1]
        new = {name: f[:, self.n_real :] for name, f in feats.items()}
        t, device = n_feats - self.n_real, tokens.device
        pos = torch.arange(self.n_real, n_feats, device=device)[None]
        out = self.step(
            self.to_hidden(new),
            self.embed(tokens[:, self.n_real + 1 : n_feats + 1]),
            pos,
            causal_mask(t, n_feats, device=device),
            self.cache,
        )
        self.n_real, self.fed, self.outs = n_feats, [], {-1: out[:, -1:]}
        return self.logits(out[:, -1:])[0, 0]

    def expand(self, draft, nodes: list[int]) -> torch.Tensor:
        """Feed draft `nodes` (whose parents were fed before) in one drafter pass -> logits [n, V]
        for their children."""
        device = self.outs[-1].device
        hidden = torch.cat([self.outs[draft.parents[i]] for i in nodes], dim=1)
        ids = torch.tensor([[draft.tokens[i] for i in nodes]], device=device)
        # Pair (parent output, node token) predicts the node's children: position n_real - 1 + depth.
        pos = torch.tensor([[self.n_real - 1 + draft.depth(i) for i in nodes]], device=device)
        keys = self.fed + nodes  # the drafter cache holds real pairs, then fed nodes in this order
        tree = draft.ancestor_rows(nodes, keys).to(device)
        mask = torch.cat([torch.ones(len(nodes), self.n_real, dtype=torch.bool, device=device), tree], dim=1)
        out = self.step(hidden, self.embed(ids), pos, mask[None, None], self.cache)
        self.fed += nodes
        self.outs.update({i: out[:, j : j + 1] for j, i in enumerate(nodes)})
        return self.logits(out)[0]

    @torch.no_grad()
    def propose(self, tokens: torch.Tensor, feats: dict, k: int, sampler=None):
        logits, draft = self._prefill(tokens, feats), Draft()
        for i in range(k):
            q = None if sampler is None else sampler.probs(logits)
            node = draft.add(int(logits.argmax()) if q is None else sampler.sample(q), i - 1, q)
            if i + 1 < k:
                logits = self.expand(draft, [node])[0]
        return draft

    @torch.no_grad()
    def propose_tree(self, tokens: torch.Tensor, feats: dict, spec):
        return grow_tree(spec, self._prefill(tokens, feats), self.expand)


def resync(proposer, ids: list[int]) -> list[int]:
    """Keep a proposer's own KV cache (`proposer.cache`, `proposer.fed`) on the longest prefix of `ids`
    it has fed -> the tokens still to feed, at least the newest one (its logits start the draft)."""
    fed = proposer.fed
    same = next((i for i, (a, b) in enumerate(zip(fed, ids)) if a != b), min(len(fed), len(ids)))
    same = min(same, len(ids) - 1)
    crop_cache(proposer.cache, same)
    proposer.fed = fed[:same]
    return ids[same:]


class StudentProposer:
    """Chain drafting by a causal LM (a distilled student, the target with layers skipped) with its
    own KV cache. Each round the cache keeps the longest prefix of what it was fed that the accepted
    tokens still agree with; the rest is fed in one pass."""

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
        logits, draft = self._feed(resync(self, ids), device), Draft()
        for i in range(k):
            q = None if sampler is None else sampler.probs(logits)
            token = int(logits.argmax()) if q is None else sampler.sample(q)
            draft.add(token, i - 1, q)
            if i + 1 < k:
                logits = self._feed([token], device)
        return draft
