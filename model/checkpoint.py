"""Checkpoint directories: reading (both key layouts, fp8/fp4 dequantised at load) and writing.

A checkpoint directory holds `config.json`, `*.safetensors` shards (+ `model.safetensors.index.json`),
`tokenizer.json` and `tokenizer_config.json`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from . import keys, quant
from .config import ModelConfig, load_config

log = logging.getLogger(__name__)

SHARD_BYTES = 2 << 30
# the weights the published checkpoints store in fp8 (routed experts: fp4), in both layouts
_FP8 = re.compile(r"(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|indexer\.wq_b|shared_experts\.w[123]|"
                  r"self_attn\.(q_a_proj|q_b_proj|kv_proj|o_a_proj|o_b_proj)|indexer\.q_b_proj|"
                  r"shared_experts\.(gate|up|down)_proj)\.weight$")
_EXPERT = re.compile(r"\.experts\.\d+\.w[123]\.weight$")
_STACKED_EXPERT = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")  # transformers: [E, out, in]
_SCALE_INV = "_scale_inv"  # transformers' suffix: X.weight -> X.weight_scale_inv, X -> X_scale_inv


def scale_name(name: str, layout: str) -> str:
    if layout == keys.OFFICIAL or name.startswith("mtp."):
        return name[: -len(".weight")] + ".scale"
    return name + _SCALE_INV


class CheckpointError(ValueError):
    pass


# ---- reading -------------------------------------------------------------------------------------

def _shard_files(d: Path) -> list[Path]:
    index = d / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [d / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} names shards that do not exist: {missing}")
        return files
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {d}")
    return files


def detect_layout(names: set[str]) -> str:
    if any(n.startswith("model.layers.") or n == "model.embed_tokens.weight" for n in names):
        return keys.TRANSFORMERS
    if any(n.startswith("layers.") or n == "embed.weight" for n in names):
        return keys.OFFICIAL
    raise CheckpointError("cannot tell the key layout: neither official (layers.N.attn...) "
                          "nor transformers (model.layers.N.self_attn...) names found")


def _wanted(name: str, layout: str, layers: range, embed: bool, head: bool) -> bool:
    m = re.match(r"^(?:model\.)?layers\.(\d+)\.", name)
    if m:
        return int(m[1]) in layers
    if name.startswith("mtp."):
        return False
    if name in ("embed.weight", "model.embed_tokens.weight"):
        return embed
    return head


def read_tensors(d: Path, cfg: ModelConfig, layers: range, embed: bool, head: bool,
                 filter_fn=None) -> tuple[dict[str, torch.Tensor], str]:
    """Read and dequantise the tensors a model (or stage) needs; returns (tensors, layout)."""
    files = _shard_files(d)
    raw: dict[str, torch.Tensor] = {}
    all_names: set[str] = set()
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            names = list(sf.keys())
            all_names.update(names)
            layout = detect_layout(all_names)
            keep = filter_fn or (lambda n: _wanted(n, layout, layers, embed, head))
            for n in names:
                base = n[: -len(".scale")] + ".weight" if n.endswith(".scale") else n.removesuffix(_SCALE_INV)
                if keep(base):
                    raw[n] = sf.get_tensor(n)
    return dequantize_all(raw, cfg), detect_layout(all_names)


def _is_scale(n: str, raw: dict) -> bool:
    return (n.endswith(".scale") and n[: -len(".scale")] + ".weight" in raw) or (
        n.endswith(_SCALE_INV) and n.removesuffix(_SCALE_INV) in raw)


def dequantize_all(raw: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    out = {}
    for n, t in raw.items():
        if _is_scale(n, raw):
            continue  # a quantisation scale, consumed with its weight
        scale = raw.get(n + _SCALE_INV)
        if scale is None and n.endswith(".weight"):
            scale = raw.get(n[: -len(".weight")] + ".scale")
        if scale is None:
            if t.dtype in (torch.float8_e4m3fn, torch.uint8, torch.int8):
                raise CheckpointError(f"{n} is quantised ({t.dtype}) but its scale tensor is missing")
            out[n] = t
        else:
            out[n] = _dequantize(n, t, scale, cfg)
    return out


def _dequantize(n: str, t: torch.Tensor, scale: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    if t.dim() == 3:  # stacked experts: one matrix per expert
        return torch.stack([_dequantize(n, t[e], scale[e], cfg) for e in range(t.shape[0])])
    if t.dtype == torch.float8_e4m3fn:
        return quant.dequantize_fp8(t, scale, cfg.quant.block)
    if t.dtype in (torch.uint8, torch.int8):
        return quant.dequantize_fp4(t, scale)
    raise CheckpointError(f"{n} has a scale but dtype {t.dtype} is neither fp8 nor packed fp4")


def load_state_into(model: torch.nn.Module, tensors: dict[str, torch.Tensor], layout: str, what: str) -> None:
    """Copy tensors (checkpoint names) into the model, naming every missing, unexpected or mis-shaped one."""
    ours = keys.official_to_ours(tensors) if layout == keys.OFFICIAL else keys.transformers_to_ours(tensors)
    expected = {k: v for k, v in model.state_dict().items() if not k.endswith("inv_freq")}
    missing = sorted(set(expected) - set(ours))
    if missing:
        raise CheckpointError(f"{what}: checkpoint lacks {len(missing)} tensor(s), e.g. {missing[:5]} "
                              f"({layout} layout)")
    for k, target in expected.items():
        src = ours[k]
        if tuple(src.shape) != tuple(target.shape):
            raise CheckpointError(f"{what}: tensor {k} has shape {tuple(src.shape)}, "
                                  f"the config implies {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(src.to(target.dtype))


def load(checkpoint_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
         layers: range | None = None, qat_sim: bool = True):
    """Load the DeepSeek-V4 target from a checkpoint directory.

    Returns a `model.target.Transformer` in eval mode whose `forward(input_ids [B, S] int64)` gives logits
    [B, S, vocab]. `layers` restricts it to a contiguous range (a pipeline stage). `qat_sim` keeps the reference's
    fp8/fp4 activation round trips (model/NOTES.md); turn it off for bit-level comparisons between paths."""
    from .target import Transformer

    d = Path(checkpoint_dir)
    cfg = dataclasses.replace(load_config(d), qat_sim=qat_sim)
    with torch.device("meta"):
        model = Transformer(cfg, layers)
    model = model.to_empty(device=device)
    _cast_(model, dtype)
    _reset_buffers(model)
    tensors, layout = read_tensors(d, cfg, model.layer_range, model.has_embed, model.has_head)
    load_state_into(model, tensors, layout, str(d))
    log.info("loaded %s (%s layout, layers %s) on %s as %s", d, layout, model.layer_range, device, dtype)
    return model.eval()


def _cast_(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Weights of linear and embedding layers take `dtype`; norms, mHC, sinks, ape and router bias stay fp32."""
    for mod in model.modules():
        if isinstance(mod, (torch.nn.Linear, torch.nn.Embedding)):
            mod.to(dtype)
    for name, p in model.named_parameters():
        if name.endswith(("experts.w1", "experts.w2", "experts.w3")):
            p.data = p.data.to(dtype)


def _reset_buffers(model: torch.nn.Module) -> None:
    from .layers import Rope  # rope buffers are derived from the config, not stored

    for mod in model.modules():
        if isinstance(mod, Rope):
            mod.inv_freq = mod.computed_inv_freq().to(mod.inv_freq.device)


def load_drafter(checkpoint_dir: str | Path, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.bfloat16, context_only: bool = False, qat_sim: bool = True):
    """Load the DSpark drafter (`mtp.*`): the full `Drafter`, or with context_only the `ContextKV` part the
    prefill side needs (main_proj/main_norm and each stage's kv path; nothing else is read)."""
    from .drafter import ContextKV, Drafter

    d = Path(checkpoint_dir)
    cfg = dataclasses.replace(load_config(d), qat_sim=qat_sim)
    with torch.device("meta"):
        drafter = ContextKV(cfg) if context_only else Drafter(cfg)
    drafter = drafter.to_empty(device=device)
    _cast_(drafter, dtype)
    _reset_buffers(drafter)
    wanted = set(drafter.state_dict())
    tensors, _ = read_tensors(d, cfg, range(0), False, False, filter_fn=lambda n: _drafter_wants(n, wanted))
    load_state_into(drafter, tensors, keys.OFFICIAL, f"{d} (drafter)")
    return drafter.eval()


def _drafter_wants(name: str, wanted: set[str]) -> bool:
    if not name.startswith("mtp."):
        return False
    if re.search(r"\.experts\.\d+\.", name):
        return any(".experts." in w for w in wanted)
    return True


# ---- writing -------------------------------------------------------------------------------------

def to_layout(sd: dict[str, torch.Tensor], cfg: ModelConfig, layout: str, fmt: str) -> dict[str, torch.Tensor]:
    """Our state dict -> checkpoint tensors in `layout`, stored as fmt (fp32 | bf16 | fp8)."""
    if layout not in keys.LAYOUTS:
        raise ValueError(f"layout must be one of {keys.LAYOUTS}, got {layout!r}")
    sd = {k: v for k, v in sd.items() if not k.endswith("inv_freq")}
    # drafter tensors (mtp.*) keep the official names in every layout (transformers ignores them)
    mtp = keys.ours_to_official({k: v for k, v in sd.items() if k.startswith("mtp.")})
    rest = {k: v for k, v in sd.items() if not k.startswith("mtp.")}
    named = keys.ours_to_official(rest) if layout == keys.OFFICIAL else keys.ours_to_transformers(rest)
    named.update(mtp)
    out = {}
    for n, t in named.items():
        t = t.detach().cpu().contiguous()
        if fmt == "fp8" and (_FP8.search(n) or _EXPERT.search(n) or _STACKED_EXPERT.search(n)):
            out[n], out[scale_name(n, layout)] = _quantize(n, t, cfg)
        elif t.dtype == torch.float32 and fmt != "fp32" and not _keeps_fp32(n):
            out[n] = t.to(torch.bfloat16)
        else:
            out[n] = t
    return {k: v.contiguous() for k, v in out.items()}


def _quantize(n: str, t: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    if t.dim() == 3:  # stacked experts
        parts = [_quantize(n, t[e], cfg) for e in range(t.shape[0])]
        return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
    expert = bool(_EXPERT.search(n) or _STACKED_EXPERT.search(n))
    if expert and cfg.quant.expert_fmt == "fp4":
        return quant.quantize_fp4(t)
    return quant.quantize_fp8(t, cfg.quant.block)


def _keeps_fp32(name: str) -> bool:
    return bool(re.search(r"(norm\.weight|hc_|hc_head|attn_sink|\.ape|gate\.bias|position_bias|sinks|"
                          r"e_score_correction_bias|\.base$|\.scale$|\.fn$)", name))


def write_shards(tensors: dict[str, torch.Tensor], out_dir: Path, shard_bytes: int = SHARD_BYTES) -> None:
    shards, cur, size = [], {}, 0
    for n in sorted(tensors):
        nb = tensors[n].numel() * tensors[n].element_size()
        if cur and size + nb > shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[n], size = tensors[n], size + nb
    shards.append(cur)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out_dir / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
