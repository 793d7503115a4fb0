"""Decode service settings (one frozen dataclass; the CLI is generated from it)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    model: str = field(metadata={"help": "checkpoint directory (same weights as the prefill service)"})
    prefill: str = field(default="127.0.0.1:50051", metadata={"help": "prefill peers, HOST:PORT[,HOST:PORT...]"})
    port: int = field(default=8000, metadata={"help": "HTTP port"})
    host: str = field(default="127.0.0.1", metadata={"help": "IP address to bind and to advertise to Mooncake"})
    served_model_name: str = field(default="", metadata={"help": "model id in the API (default: the directory "
                                                                 "name)"})
    api_key: str = field(default="", metadata={"help": "require 'Authorization: Bearer KEY' (empty: no auth)"})
    spec: bool = field(default=True, metadata={"help": "DSpark speculative decoding (if the checkpoint has it)"})
    device: str = field(default="auto", metadata={"help": "cpu, cuda, cuda:N or auto"})
    dtype: str = field(default="auto", metadata={"help": "float32, bfloat16 or auto",
                                                 "choices": ["auto", "float32", "bfloat16"]})
    max_running: int = field(default=32, metadata={"help": "requests decoding at once"})
    max_queued: int = field(default=64, metadata={"help": "requests waiting for admission; beyond: 429"})
    cache_tokens: int = field(default=0, metadata={
        "help": "tokens of cache for all running requests (0: what --cache-memory-fraction of the GPU memory left "
                "after loading the model holds, at most --max-running full contexts; 65536 on the CPU)"})
    cache_memory_fraction: float = field(default=0.5, metadata={
        "help": "share of the free GPU memory the cache may take when --cache-tokens is 0"})
    max_model_len: int = field(default=0, metadata={"help": "prompt + completion tokens per request (0: the "
                                                            "model's limit, capped by --cache-tokens)"})
    arena_mib: int = field(default=256, metadata={"help": "Mooncake receive arena (MiB)"})
    protocol: str = field(default="tcp", metadata={"help": "Mooncake protocol",
                                                   "choices": ["tcp", "rdma", "nvlink_intra"]})
    device_names: str = field(default="", metadata={"help": "Mooncake device filter (RDMA NICs)"})
    prefill_timeout_s: float = field(default=60.0, metadata={"help": "deadline of one prefill RPC (seconds)"})
    cuda_graphs: bool = field(default=True, metadata={"help": "capture decode steps as CUDA graphs (GPU only)"})
    qat_sim: bool = field(default=True, metadata={"help": "the reference's fp8/fp4 activation simulations"})
    threads: int = field(default=0, metadata={"help": "CPU threads for the engine (0: torch default)"})
    switch_interval_ms: float = field(default=0.5, metadata={
        "help": "Python thread switch interval (ms): short, so the engine thread and the HTTP event loop hand the "
                "GIL over quickly (Python's 5 ms default added ~4 ms per decode step on an H200)"})

    def __post_init__(self):
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be in 1..65535, got {self.port}")
        if not self.peers:
            raise ValueError("--prefill needs at least one HOST:PORT")
        for p in self.peers:
            host, _, port = p.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"--prefill entry {p!r} is not HOST:PORT")
        if self.max_running < 1 or self.max_queued < 0:
            raise ValueError(f"--max-running ({self.max_running}) must be >= 1 and --max-queued "
                             f"({self.max_queued}) >= 0")
        if self.max_model_len < 0 or self.cache_tokens < 0 or 0 < self.cache_tokens < self.max_model_len:
            raise ValueError(f"--cache-tokens ({self.cache_tokens}) must hold at least one request of "
                             f"--max-model-len ({self.max_model_len}) tokens")
        if not 0 < self.cache_memory_fraction <= 1:
            raise ValueError(f"--cache-memory-fraction must be in (0, 1], got {self.cache_memory_fraction}")
        if self.switch_interval_ms <= 0:
            raise ValueError(f"--switch-interval-ms must be > 0, got {self.switch_interval_ms}")
        if self.prefill_timeout_s <= 0:
            raise ValueError(f"--prefill-timeout-s must be > 0, got {self.prefill_timeout_s}")

    @property
    def peers(self) -> list[str]:
        return [p.strip() for p in self.prefill.split(",") if p.strip()]
