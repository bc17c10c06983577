"""The config.json of the targets and students draftsmith's recipes name, offline: what `plan` sizes
without hub access, and what the test suite shrinks into tiny random targets of the same
architecture (`tiny_config`), so RoPE scaling, q/k norm, attention biases and tying are exercised as
users' real targets have them.

Values are the architecture-defining keys of each model's published config.json (2026-12).
"""

from __future__ import annotations

from transformers import AutoConfig, PretrainedConfig

from draftsmith import DraftsmithError
from draftsmith.target.load import resolve_target

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
_LLAMA31 = dict(
    model_type="llama",
    architectures=["LlamaForCausalLM"],
    vocab_size=128256,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling=_LLAMA3_ROPE,
    max_position_embeddings=131072,
    bos_token_id=128000,
    eos_token_id=[128001, 128008, 128009],
    tie_word_embeddings=False,
    attention_bias=False,
    mlp_bias=False,
    hidden_act="silu",
)
_QWEN2 = dict(
    model_type="qwen2",
    architectures=["Qwen2ForCausalLM"],
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    max_position_embeddings=32768,
    bos_token_id=151643,
    eos_token_id=151645,
    hidden_act="silu",
    use_sliding_window=False,
    sliding_window=131072,
)
# What Qwen3's dense and MoE models share: the attention (32 heads of head_dim 128, q/k norm), the
# tokenizer, the RoPE base and the context length.
_QWEN3 = dict(
    num_attention_heads=32,
    head_dim=128,
    vocab_size=151936,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    max_position_embeddings=40960,
    bos_token_id=151643,
    eos_token_id=151645,
    tie_word_embeddings=False,
    attention_bias=False,
    hidden_act="silu",
)

KNOWN_CONFIGS: dict[str, dict] = {
    "meta-llama/Llama-3.1-8B-Instruct": dict(
        _LLAMA31,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
    ),
    "meta-llama/Llama-3.1-70B-Instruct": dict(
        _LLAMA31,
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
    ),
    # The students of the Llama-3.1 distill recipes: same tokenizer, llama3 RoPE with factor 32, tied.
    "meta-llama/Llama-3.2-1B-Instruct": dict(
        _LLAMA31,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        tie_word_embeddings=True,
        rope_scaling=dict(_LLAMA3_ROPE, factor=32.0),
    ),
    "meta-llama/Llama-3.2-3B-Instruct": dict(
        _LLAMA31,
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
        rope_scaling=dict(_LLAMA3_ROPE, factor=32.0),
    ),
    "lmsys/vicuna-7b-v1.3": dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
        rms_norm_eps=1e-6,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        hidden_act="silu",
    ),
    # Qwen3: q/k RMSNorm in every attention layer, head_dim 128 independent of hidden/heads.
    "Qwen/Qwen3-8B": dict(
        _QWEN3,
        model_type="qwen3",
        architectures=["Qwen3ForCausalLM"],
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_key_value_heads=8,
    ),
    # Qwen2.5: biases on q/k/v.
    "Qwen/Qwen2.5-7B-Instruct": dict(
        _QWEN2,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
    # Qwen3 MoE (huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json): Qwen3's attention (q/k
    # norm, head_dim 128) with a sparse MLP in every layer (decoder_sparse_step 1, no mlp_only_layers):
    # 128 experts of width moe_intermediate_size, 8 routed per token, top-k weights renormalised.
    # `intermediate_size` (6144) sizes only dense layers, which this model has none of.
    "Qwen/Qwen3-30B-A3B": dict(
        _QWEN3,
        model_type="qwen3_moe",
        architectures=["Qwen3MoeForCausalLM"],
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        mlp_only_layers=[],
        num_hidden_layers=48,
        num_key_value_heads=4,
        rope_scaling=None,
        use_sliding_window=False,
        sliding_window=None,
    ),
    # Gemma-3 text (huggingface.co/google/gemma-3-1b-it/blob/main/config.json): embeddings scaled by
    # sqrt(hidden_size), (1 + weight) RMSNorms, q/k norm, attention scaled by query_pre_attn_scalar;
    # five sliding-window layers (RoPE base rope_local_base_freq) to one global layer (rope_theta).
    # tie_word_embeddings is not in the file: Gemma3TextConfig's default, true.
    "google/gemma-3-1b-it": dict(
        model_type="gemma3_text",
        architectures=["Gemma3ForCausalLM"],
        hidden_size=1152,
        intermediate_size=6912,
        num_hidden_layers=26,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        query_pre_attn_scalar=256,
        vocab_size=262144,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        rope_local_base_freq=10000.0,
        rope_scaling=None,
        sliding_window=512,
        sliding_window_pattern=6,
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
        max_position_embeddings=32768,
        bos_token_id=2,
        eos_token_id=[1, 106],
        pad_token_id=0,
        tie_word_embeddings=True,
        attention_bias=False,
        hidden_activation="gelu_pytorch_tanh",
    ),
    "Qwen/Qwen2.5-0.5B-Instruct": dict(
        _QWEN2,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
}


def model_config(name: str, cache_dir: str = "", what: str = "target") -> PretrainedConfig:
    """The config of a target or a distill student (`what` names it in the error): the published one
    for the models above, so every GPU recipe plans offline, else its config.json."""

    known = known_config(name)
    if known is not None:
        return known
    try:
        return AutoConfig.from_pretrained(resolve_target(name, cache_dir))
    except OSError as e:
        raise DraftsmithError(
            f"cannot read the config of {what} '{name}' ({str(e).splitlines()[0]}); "
            f"known offline: {', '.join(KNOWN_CONFIGS)}"
        ) from None


def known_config(name: str) -> PretrainedConfig | None:
    """The transformers config of a known model id (None for others)."""
    if name not in KNOWN_CONFIGS:
        return None
    values = dict(KNOWN_CONFIGS[name])
    return AutoConfig.for_model(values.pop("model_type"), **values)


def tiny_config(
    name: str,
    vocab_size: int,
    layers: int = 4,
    hidden: int = 64,
    heads: int = 2,
    kv_heads: int = 1,
    head_dim: int = 32,
    **extra,
) -> PretrainedConfig:
    """`name`'s architecture at test size: its RoPE type and scaling, norms, biases and tying, with
    small dimensions (head_dim 32: the smallest vLLM's CPU attention takes) and a test tokenizer's
    vocabulary. The RoPE scaling keeps its factors; `original_max_position_embeddings` shrinks with
    the context so the scaled band is inside the positions tests reach, as a sliding window does; an
    MoE keeps its routing with 4 small experts, top-2."""
    values = dict(KNOWN_CONFIGS[name])
    values.update(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=vocab_size,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if values.get("rope_scaling"):
        values["rope_scaling"] = dict(values["rope_scaling"], original_max_position_embeddings=64)
    if "num_experts" in values:  # MoE: 4 experts of width hidden/2, 2 routed per token
        values.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden // 2)
    if values.get("sliding_window_pattern"):
        # Gemma-3: the window shrinks with the context (tests' prompts and answers outrun it) and
        # every second layer is global, so a few layers have both kinds.
        values.update(sliding_window=16, sliding_window_pattern=2)
    values.update(extra)
    return AutoConfig.for_model(values.pop("model_type"), **values)
