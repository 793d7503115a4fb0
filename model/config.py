"""Model configuration parsed from a checkpoint's `config.json` (the official DeepSeek-V4 keys).

Knows the architecture hyper-parameters and derived per-layer facts (attention kind, rope regime, routing kind).
Does not know about weights, devices or serving settings.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

SWA, CSA, HCA = "swa", "csa", "hca"
_KIND_BY_RATIO = {0: SWA, 4: CSA, 128: HCA}


@dataclass(frozen=True, slots=True)
class YarnConfig:
    """YaRN scaling of the compressed-attention rope (`rope_scaling` in config.json)."""

    factor: float = 1.0
    original_max_position_embeddings: int = 0  # 0: no YaRN
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True, slots=True)
class QuantConfig:
    """How weights are stored on disk (`quantization_config`); dequantised at load."""

    weight_fmt: str = "bf16"  # bf16 | fp8 (e4m3 with block scales)
    block: tuple[int, int] = (128, 128)  # fp8 scale block [out, in]
    expert_fmt: str = "bf16"  # routed experts: bf16 | fp8 | fp4 (e2m1 with per-32 scales)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    compress_ratios: tuple[int, ...]  # per layer: 0 SWA, 4 CSA, 128 HCA (trailing entries: MTP layers)
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    num_hash_layers: int
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    swiglu_limit: float = 0.0  # 0: no clamp
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    yarn: YarnConfig = field(default_factory=YarnConfig)
    max_position_embeddings: int = 65536
    rms_norm_eps: float = 1e-6
    bos_token_id: int = 0
    eos_token_id: int = 1
    tie_word_embeddings: bool = False
    quant: QuantConfig = field(default_factory=QuantConfig)
    # DSpark drafter (-0731 release); 0 drafter layers when absent
    dspark_num_layers: int = 0
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_markov_rank: int = 0
    dspark_block_size: int = 0
    dspark_noise_token_id: int = 0
    # run the reference's quantisation-aware simulations (fp8 round trip of KV nope dims, Hadamard + fp4 round trip
    # of indexer q/k); a runtime choice, not a config.json key
    qat_sim: bool = True
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        if len(self.compress_ratios) < self.num_hidden_layers:
            raise ValueError(f"compress_ratios has {len(self.compress_ratios)} entries, "
                             f"num_hidden_layers is {self.num_hidden_layers}")
        bad = sorted({r for r in self.compress_ratios if r not in _KIND_BY_RATIO})
        if bad:
            raise ValueError(f"compress_ratios may only hold 0, 4 or 128; got {bad}")
        if self.num_attention_heads % self.o_groups:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} not divisible by "
                             f"o_groups={self.o_groups}")
        if self.scoring_func not in ("sqrtsoftplus", "softmax", "sigmoid"):
            raise ValueError(f"scoring_func {self.scoring_func!r} is not one of sqrtsoftplus, softmax, sigmoid")
        for t in self.dspark_target_layer_ids:
            if not 0 <= t < self.num_hidden_layers:
                raise ValueError(f"dspark_target_layer_ids holds {t}, outside 0..{self.num_hidden_layers - 1}")

    # ---- derived per-layer facts -------------------------------------------------------------
    def ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    def kind(self, layer: int) -> str:
        return _KIND_BY_RATIO[self.compress_ratios[layer]]

    def carry_shape(self, layer: int, indexer: bool = False) -> tuple[int, int]:
        """(tokens, width) of the compressor projections a CSA/HCA layer carries between calls: the longest
        partial span (2r - 1 with CSA's overlap, r - 1 without) at twice the head width with overlap."""
        r, overlap = self.ratio(layer), self.kind(layer) == CSA
        if r == 0:
            raise ValueError(f"layer {layer} has no compressor")
        head = self.index_head_dim if indexer else self.head_dim
        return r * (2 if overlap else 1) - 1, head * (2 if overlap else 1)

    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.num_hash_layers

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        return tuple(self.kind(i) for i in range(self.num_hidden_layers))

    @property
    def has_dspark(self) -> bool:
        return self.dspark_num_layers > 0

    def to_json(self) -> dict:
        """The config.json dict (official keys) this config was or would be read from."""
        out = {k: v for k, v in self.raw.items()}
        for f in dataclasses.fields(self):
            if f.name in ("raw", "yarn", "quant", "dspark_num_layers", "qat_sim"):
                continue
            v = getattr(self, f.name)
            out[f.name] = list(v) if isinstance(v, tuple) else v
        out["rope_scaling"] = None if self.yarn.original_max_position_embeddings == 0 else {
            "type": "yarn", "factor": self.yarn.factor,
            "original_max_position_embeddings": self.yarn.original_max_position_embeddings,
            "beta_fast": self.yarn.beta_fast, "beta_slow": self.yarn.beta_slow}
        out["num_nextn_predict_layers"] = self.dspark_num_layers
        out["num_key_value_heads"] = 1
        out["model_type"] = "deepseek_v4"
        if self.quant.weight_fmt == "fp8":
            out["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                          "weight_block_size": list(self.quant.block)}
            out["expert_dtype"] = self.quant.expert_fmt
        else:
            out.pop("quantization_config", None)
            out.pop("expert_dtype", None)
        out["torch_dtype"] = "bfloat16"
        return out


_SIMPLE_KEYS = {f.name for f in dataclasses.fields(ModelConfig)} - {"yarn", "quant", "raw", "dspark_num_layers",
                                                                  "qat_sim"}


def config_from_dict(d: dict) -> ModelConfig:
    """Parse a config.json dict with the official DeepSeek-V4 keys."""
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                           "q_lora_rank", "compress_ratios") if k not in d]
    if missing:
        raise ValueError(f"config.json lacks required keys: {missing}")
    kw = {k: d[k] for k in _SIMPLE_KEYS if k in d and d[k] is not None}
    for k in ("compress_ratios", "dspark_target_layer_ids"):
        if k in kw:
            kw[k] = tuple(kw[k])
    if isinstance(kw.get("eos_token_id"), list):
        kw["eos_token_id"] = kw["eos_token_id"][0]
    kw.setdefault("qk_rope_head_dim", 64)
    rs = d.get("rope_scaling") or {}
    if rs:
        kw["yarn"] = YarnConfig(factor=float(rs.get("factor", 1.0)),
                                original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 0)),
                                beta_fast=float(rs.get("beta_fast", 32)), beta_slow=float(rs.get("beta_slow", 1)))
    kw["quant"] = _parse_quant(d)
    if d.get("dspark_target_layer_ids"):
        kw["dspark_num_layers"] = int(d.get("num_nextn_predict_layers", 0))
    return ModelConfig(raw=dict(d), **kw)


def _parse_quant(d: dict) -> QuantConfig:
    q = d.get("quantization_config") or {}
    if not q:
        return QuantConfig()
    if q.get("quant_method") != "fp8":
        raise ValueError(f"unsupported quantization_config.quant_method {q.get('quant_method')!r} (only fp8)")
    expert = q.get("expert_dtype", d.get("expert_dtype", "fp8")) or "fp8"
    return QuantConfig(weight_fmt="fp8", block=tuple(q.get("weight_block_size", (128, 128))), expert_fmt=expert)


def load_config(checkpoint_dir: str | Path) -> ModelConfig:
    path = Path(checkpoint_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: a checkpoint directory holds config.json")
    return config_from_dict(json.loads(path.read_text()))
