"""Checkpoint key layouts: our module names <-> the official layout <-> the transformers layout.

Our module names follow the official layout except in three places: hyper-connection parameters live in a
submodule (`hc_attn.fn` for `hc_attn_fn`), `hc_head.fn` for `hc_head_fn`, and routed experts are stacked
(`ffn.experts.w1` [E, I, H] for `ffn.experts.{e}.w1.weight`).
"""

from __future__ import annotations

import re

import torch

OFFICIAL, TRANSFORMERS = "official", "transformers"
LAYOUTS = (OFFICIAL, TRANSFORMERS)

_EXPERT = re.compile(r"^(.*\.experts)\.(w[123])$")
_OFFICIAL_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(w[123])\.weight$")

# (our name prefix, transformers name prefix) after "layers.N." / "model.layers.N."
_HF_LAYER = [
    ("attn_norm.", "input_layernorm."), ("ffn_norm.", "post_attention_layernorm."),
    ("hc_attn.", "attn_hc."), ("hc_ffn.", "ffn_hc."),
    ("attn.indexer.compressor.wkv.", "self_attn.compressor.indexer.kv_proj."),
    ("attn.indexer.compressor.wgate.", "self_attn.compressor.indexer.gate_proj."),
    ("attn.indexer.compressor.ape", "self_attn.compressor.indexer.position_bias"),
    ("attn.indexer.compressor.norm.", "self_attn.compressor.indexer.kv_norm."),
    ("attn.indexer.wq_b.", "self_attn.compressor.indexer.q_b_proj."),
    ("attn.indexer.weights_proj.", "self_attn.compressor.indexer.scorer.weights_proj."),
    ("attn.compressor.wkv.", "self_attn.compressor.kv_proj."),
    ("attn.compressor.wgate.", "self_attn.compressor.gate_proj."),
    ("attn.compressor.ape", "self_attn.compressor.position_bias"),
    ("attn.compressor.norm.", "self_attn.compressor.kv_norm."),
    ("attn.wq_a.", "self_attn.q_a_proj."), ("attn.q_norm.", "self_attn.q_a_norm."),
    ("attn.wq_b.", "self_attn.q_b_proj."), ("attn.wkv.", "self_attn.kv_proj."),
    ("attn.kv_norm.", "self_attn.kv_norm."), ("attn.wo_a.", "self_attn.o_a_proj."),
    ("attn.wo_b.", "self_attn.o_b_proj."), ("attn.attn_sink", "self_attn.sinks"),
    ("ffn.gate.bias", "mlp.gate.e_score_correction_bias"), ("ffn.gate.", "mlp.gate."),
    ("ffn.shared_experts.w1.", "mlp.shared_experts.gate_proj."),
    ("ffn.shared_experts.w2.", "mlp.shared_experts.down_proj."),
    ("ffn.shared_experts.w3.", "mlp.shared_experts.up_proj."),
]
_HF_TOP = {"embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight",
           "norm.weight": "model.norm.weight", "hc_head.fn": "model.hc_head.hc_fn",
           "hc_head.base": "model.hc_head.hc_base", "hc_head.scale": "model.hc_head.hc_scale"}
_LAYER = re.compile(r"^layers\.(\d+)\.(.*)$")


# ---- ours <-> official ---------------------------------------------------------------------------

def ours_to_official(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in sd.items():
        m = _EXPERT.match(k)
        if m:
            for e in range(v.shape[0]):
                out[f"{m[1]}.{e}.{m[2]}.weight"] = v[e]
            continue
        k = re.sub(r"\.hc_(attn|ffn)\.(fn|base|scale)$", r".hc_\1_\2", k)
        k = re.sub(r"(^|\.)hc_head\.(fn|base|scale)$", r"\1hc_head_\2", k)
        out[k] = v
    return out


def official_to_ours(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out, experts = {}, {}
    for k, v in tensors.items():
        m = _OFFICIAL_EXPERT.match(k)
        if m:
            experts.setdefault(f"{m[1]}.{m[3]}", {})[int(m[2])] = v
            continue
        k = re.sub(r"\.hc_(attn|ffn)_(fn|base|scale)$", r".hc_\1.\2", k)
        k = re.sub(r"(^|\.)hc_head_(fn|base|scale)$", r"\1hc_head.\2", k)
        out[k] = v
    for k, per_expert in experts.items():
        n = max(per_expert) + 1
        missing = [e for e in range(n) if e not in per_expert]
        if missing:
            raise KeyError(f"checkpoint lacks experts {missing} of {k}")
        out[k] = torch.stack([per_expert[e] for e in range(n)])
    return out


# ---- ours <-> transformers -----------------------------------------------------------------------

def _rename(rest: str, pairs: list[tuple[str, str]], full: str) -> str:
    for src, dst in sorted(pairs, key=lambda p: -len(p[0])):
        if rest.startswith(src):
            return dst + rest[len(src):]
    raise KeyError(f"no mapping for tensor {full}")


def ours_to_transformers(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out, stacked = {}, {}
    for k, v in sd.items():
        if k in _HF_TOP:
            out[_HF_TOP[k]] = v
            continue
        layer, rest = _LAYER.match(k).groups()
        m = re.match(r"ffn\.experts\.(w[123])$", rest)
        if m:
            stacked.setdefault(layer, {})[m[1]] = v
            continue
        out[f"model.layers.{layer}.{_rename(rest, _HF_LAYER, k)}"] = v
    for layer, w in stacked.items():
        out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.cat((w["w1"], w["w3"]), 1)
        out[f"model.layers.{layer}.mlp.experts.down_proj"] = w["w2"]
    return out


def transformers_to_ours(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    top = {v: k for k, v in _HF_TOP.items()}
    reverse = [(hf, ours) for ours, hf in _HF_LAYER]
    out = {}
    for k, v in tensors.items():
        if k in top:
            out[top[k]] = v
            continue
        m = re.match(r"^model\.layers\.(\d+)\.(.*)$", k)
        if not m:
            raise KeyError(f"unexpected tensor {k} in a transformers-layout checkpoint")
        layer, rest = m.groups()
        if rest == "mlp.experts.gate_up_proj":
            w1, w3 = v.chunk(2, dim=1)
            out[f"layers.{layer}.ffn.experts.w1"], out[f"layers.{layer}.ffn.experts.w3"] = w1, w3
        elif rest == "mlp.experts.down_proj":
            out[f"layers.{layer}.ffn.experts.w2"] = v
        else:
            out[f"layers.{layer}.{_rename(rest, reverse, k)}"] = v
    return out
