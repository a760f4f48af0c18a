"""transformers configs built from their config classes alone (no download): tiny ones for tests
and the CPU example, and the full-size shapes of Qwen3-30B-A3B and DeepSeek-V3 for benchmarks.

Every function imports transformers when called.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TINY_FAMILIES", "PRESETS", "tiny_config", "preset_config", "causal_lm_class", "tiny_random_model"]

#: families with a tiny test config
TINY_FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3")

#: full-size presets: name -> (family, description)
PRESETS = {
    "qwen3-30b-a3b": ("qwen3_moe", "Qwen3-30B-A3B: 48 layers, hidden 2048, 128 experts, top-8, "
                                   "expert intermediate 768, 32/4 heads"),
    "deepseek-v3": ("deepseek_v3", "DeepSeek-V3 layers: hidden 7168, 256 experts (8 groups, top-4 "
                                   "groups), top-8, expert intermediate 2048, 1 shared expert, MLA"),
}


def causal_lm_class(family: str) -> type:
    """The ``...ForCausalLM`` class of ``family``."""
    import transformers

    names = {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
             "deepseek_v3": "DeepseekV3ForCausalLM"}
    if family not in names:
        raise ValueError(f"unknown family {family!r}; choose from {sorted(names)}")
    return getattr(transformers, names[family])


def tiny_config(family: str, *, num_experts: int = 8, topk: int = 2, layers: int = 2,
                **overrides: Any) -> Any:
    """A tiny config of ``family`` (hidden 32, vocab 64, float32 weights by default).

    DeepSeek-V3's has one dense first layer, one shared expert, 2 expert groups of which the
    router keeps 1, a routed scaling factor of 2.5 and MLA attention.
    """
    import transformers

    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, num_experts_per_tok=topk,
                  tie_word_embeddings=False)
    if family == "qwen3_moe":
        kw = dict(common, intermediate_size=64, moe_intermediate_size=16, num_experts=num_experts,
                  head_dim=8, norm_topk_prob=True)
        cls = transformers.Qwen3MoeConfig
    elif family == "mixtral":
        kw = dict(common, intermediate_size=16, num_local_experts=num_experts, head_dim=8)
        cls = transformers.MixtralConfig
    elif family == "deepseek_v3":
        kw = dict(common, num_key_value_heads=4, intermediate_size=64, moe_intermediate_size=16,
                  n_routed_experts=num_experts, n_shared_experts=1, n_group=2, topk_group=1,
                  first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                  q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                  v_head_dim=8, rope_scaling=None)
        kw["num_hidden_layers"] = layers + 1
        cls = transformers.DeepseekV3Config
    else:
        raise ValueError(f"unknown family {family!r}; choose from {list(TINY_FAMILIES)}")
    kw.update(overrides)
    return cls(**kw)


def preset_config(name: str, *, layers: int | None = None, **overrides: Any) -> Any:
    """The full-size config ``name`` (a key of :data:`PRESETS`), bf16, ``layers`` decoder layers
    (default: Qwen3-30B-A3B's 48; DeepSeek-V3: 4, the first dense as in the model)."""
    import torch
    import transformers

    if name == "qwen3-30b-a3b":
        kw = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                  moe_intermediate_size=768, num_hidden_layers=48 if layers is None else layers,
                  num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                  num_experts_per_tok=8, norm_topk_prob=True, rms_norm_eps=1e-6,
                  max_position_embeddings=40960, tie_word_embeddings=False)
        cls = transformers.Qwen3MoeConfig
    elif name == "deepseek-v3":
        n = 4 if layers is None else layers
        kw = dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                  moe_intermediate_size=2048, num_hidden_layers=n, first_k_dense_replace=min(1, n - 1),
                  num_attention_heads=128, num_key_value_heads=128, n_routed_experts=256,
                  n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
                  routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=1536, kv_lora_rank=512,
                  qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, rope_scaling=None,
                  max_position_embeddings=16384, tie_word_embeddings=False)
        cls = transformers.DeepseekV3Config
    else:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    kw.update(overrides)
    cfg = cls(**kw)
    cfg.dtype = torch.bfloat16
    return cfg


def tiny_random_model(family: str, seed: int = 0, std: float = 0.3) -> Any:
    """The tiny ``family`` causal LM (:func:`tiny_config`) with every parameter drawn from
    N(0, ``std``), seeded: ``std`` 0.3 is large enough that routing differs token to token (the
    tests' models)."""
    import torch

    torch.manual_seed(seed)
    model = causal_lm_class(family)(tiny_config(family)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, std)
    return model
