"""Building the decode side's runtime from its config: model (+ drafter), engine, Mooncake arena, prefill peers."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import torch

import model
from engine.devices import resolve_device
from engine.engine import Engine
from engine.proposer import DSparkProposer
from engine.runner import CacheSizing, cache_tokens_within
from model.cache import ratios_of
from model.checkpoint import load_drafter
from model.tokenizer import Tokenizer
from transfer.layout import layout_hash
from transfer.mooncake import MooncakeEngine

from .admission import Admission
from .config import DecodeConfig
from .generation import ServiceContext
from .kv_receiver import KVReceiver
from .metrics import DecodeMetrics
from .worker import EngineWorker

log = logging.getLogger(__name__)


def model_name(cfg: DecodeConfig) -> str:
    return cfg.served_model_name or Path(cfg.model).resolve().name


CPU_CACHE_TOKENS = 65536


def default_cache_tokens(cfg: DecodeConfig, target, proposer, lookahead: int, device: torch.device,
                         dtype: torch.dtype) -> int:
    """--cache-tokens 0: on a GPU, as many tokens as --cache-memory-fraction of the memory free after loading the
    model holds (at most --max-running full contexts); a fixed amount on the CPU."""
    context = (cfg.max_model_len or target.cfg.max_position_embeddings) + lookahead
    if device.type != "cuda":
        return max(CPU_CACHE_TOKENS, context if cfg.max_model_len else 0)
    free, _ = torch.cuda.mem_get_info(device)
    budget = int(free * cfg.cache_memory_fraction)
    layers = list(target.layer_range) + list(proposer.layers if proposer else ())
    cap = -(-cfg.max_running * context // 1024) * 1024  # every running request at its longest
    tokens = cache_tokens_within(target.cfg, layers, ratios_of(target.cfg, target.layer_range), dtype,
                                 cfg.max_running, budget, cap)
    need = context if cfg.max_model_len else 1024  # else the context shrinks to fit the cache
    if tokens < need:
        raise ValueError(f"{budget / 2**30:.2f} GiB for the cache (--cache-memory-fraction "
                         f"{cfg.cache_memory_fraction} of {free / 2**30:.2f} GiB free) holds {tokens} tokens, "
                         f"fewer than the {need} one request needs")
    log.info("cache: %d tokens in at most %.2f GiB (%.0f%% of %.2f GiB free)", tokens, budget / 2**30,
             100 * cfg.cache_memory_fraction, free / 2**30)
    return tokens


def build_context(cfg: DecodeConfig, loop: asyncio.AbstractEventLoop) -> ServiceContext:
    """Everything but the prefill peers (whose gRPC channels belong to the event loop)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device, dtype = resolve_device(cfg.device, cfg.dtype)
    target = model.load(cfg.model, device=device, dtype=dtype, qat_sim=cfg.qat_sim)
    mcfg = target.cfg
    if cfg.max_model_len > mcfg.max_position_embeddings:
        raise ValueError(f"--max-model-len {cfg.max_model_len} exceeds the model's max_position_embeddings "
                         f"{mcfg.max_position_embeddings}")
    proposer = None
    if cfg.spec and mcfg.has_dspark:
        proposer = DSparkProposer(load_drafter(cfg.model, device=device, dtype=dtype, qat_sim=cfg.qat_sim), target)
    lookahead = proposer.block_size + 1 if proposer else 1
    cache_tokens = cfg.cache_tokens or default_cache_tokens(cfg, target, proposer, lookahead, device, dtype)
    if cfg.max_model_len + lookahead > cache_tokens:
        raise ValueError(f"the cache ({cache_tokens} tokens) cannot hold one request of --max-model-len "
                         f"{cfg.max_model_len} (+{lookahead} lookahead)")
    # a request holds prompt + completion + one step's lookahead of cache
    max_model_len = cfg.max_model_len or min(mcfg.max_position_embeddings, cache_tokens - lookahead)
    tokenizer = Tokenizer(cfg.model)
    sizing = CacheSizing(max_requests=cfg.max_running, max_tokens=cache_tokens)
    engine = Engine(target, tokenizer, sizing, proposer=proposer, cuda_graphs=cfg.cuda_graphs,
                    max_model_len=max_model_len)
    mooncake = MooncakeEngine(cfg.host, cfg.protocol, cfg.device_names)
    receiver = KVReceiver(mcfg, dtype, mooncake, cfg.arena_mib << 20, device)
    metrics = DecodeMetrics()
    worker = EngineWorker(engine, receiver, loop, metrics, cfg.threads)
    h = layout_hash(mcfg, dtype)
    log.info("decode runtime: %s on %s as %s, speculation %s, layout %s, mooncake %s", cfg.model, device, dtype,
             f"DSpark block {proposer.block_size}" if proposer else "off", h, mooncake.session)
    return ServiceContext(cfg=cfg, model_name=model_name(cfg), tokenizer=tokenizer, worker=worker, receiver=receiver,
                          peers=None, admission=Admission(cfg.max_running, cfg.max_queued, cache_tokens),
                          metrics=metrics, layout_hash=h, vocab_size=mcfg.vocab_size, lookahead=lookahead,
                          eos_id=mcfg.eos_token_id, max_model_len=max_model_len)
