"""Named configurations: `tiny` (CPU tests, bundled), `small` (GPU benchmarks, Flash per-head shapes) and
`flash` (the published DeepSeek-V4-Flash config.json values, for shape and parameter-count checks)."""

from __future__ import annotations

from .config import ModelConfig, config_from_dict

_COMMON = {
    "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True, "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6, "rms_norm_eps": 1e-6, "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
    "num_key_value_heads": 1, "hidden_act": "silu", "model_type": "deepseek_v4",
}

TINY = {
    **_COMMON,
    "vocab_size": 1024, "hidden_size": 128, "num_hidden_layers": 6, "num_attention_heads": 4, "head_dim": 72,
    "qk_rope_head_dim": 8, "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 16, "sliding_window": 16,
    # every attention kind, hash layers first; the trailing entries belong to the drafter layers
    "compress_ratios": [0, 4, 128, 4, 128, 0, 0, 0], "num_hash_layers": 2,
    "index_n_heads": 8, "index_head_dim": 32, "index_topk": 8,
    "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
    "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "hc_mult": 4,
    "rope_theta": 10000.0, "compress_rope_theta": 160000.0, "max_position_embeddings": 1024,
    "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 256,
                     "beta_fast": 32, "beta_slow": 1},
    "num_nextn_predict_layers": 2, "dspark_target_layer_ids": [3, 4, 5], "dspark_markov_rank": 16,
    "dspark_block_size": 4, "dspark_noise_token_id": 3,
}

SMALL = {
    **_COMMON,
    "vocab_size": 32768, "hidden_size": 2048, "num_hidden_layers": 8, "num_attention_heads": 16, "head_dim": 512,
    "qk_rope_head_dim": 64, "q_lora_rank": 512, "o_groups": 8, "o_lora_rank": 512, "sliding_window": 128,
    "compress_ratios": [0, 4, 128, 4, 128, 4, 128, 0, 0, 0, 0], "num_hash_layers": 2,
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
    "n_routed_experts": 32, "n_shared_experts": 1, "num_experts_per_tok": 6, "moe_intermediate_size": 1024,
    "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "hc_mult": 4,
    "rope_theta": 10000.0, "compress_rope_theta": 160000.0, "max_position_embeddings": 1048576,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "num_nextn_predict_layers": 3, "dspark_target_layer_ids": [5, 6, 7], "dspark_markov_rank": 256,
    "dspark_block_size": 5, "dspark_noise_token_id": 3,
}

FLASH = {
    **_COMMON,
    "vocab_size": 129280, "hidden_size": 4096, "num_hidden_layers": 43, "num_attention_heads": 64,
    "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024,
    "sliding_window": 128, "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0], "num_hash_layers": 3,
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 6, "moe_intermediate_size": 2048,
    "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "hc_mult": 4,
    "rope_theta": 10000.0, "compress_rope_theta": 160000.0, "max_position_embeddings": 1048576,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "num_nextn_predict_layers": 1,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                            "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
}

PRESETS = {"tiny": TINY, "small": SMALL, "flash": FLASH}


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return config_from_dict(dict(PRESETS[name]))
