"""Prefill service settings (one frozen dataclass; the CLI is generated from it)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class PrefillConfig:
    model: str = field(metadata={"help": "checkpoint directory"})
    pp: int = field(default=1, metadata={"help": "pipeline stages (processes) on this node"})
    port: int = field(default=50051, metadata={"help": "gRPC port"})
    host: str = field(default="127.0.0.1", metadata={"help": "IP address to bind and to advertise to Mooncake"})
    metrics_port: int = field(default=0, metadata={"help": "Prometheus metrics port (0: none)"})
    protocol: str = field(default="tcp", metadata={"help": "Mooncake protocol",
                                                   "choices": ["tcp", "rdma", "nvlink_intra"]})
    device_names: str = field(default="", metadata={"help": "Mooncake device filter (RDMA NICs), comma separated"})
    device: str = field(default="auto", metadata={"help": "cpu, cuda or auto; stage i uses cuda:i"})
    dtype: str = field(default="auto", metadata={"help": "float32, bfloat16 or auto",
                                                 "choices": ["auto", "float32", "bfloat16"]})
    max_prompt_tokens: int = field(default=8192, metadata={"help": "longest accepted prompt (tokens)"})
    batch_tokens: int = field(default=16384, metadata={"help": "prompt tokens per scheduling round"})
    chunk_tokens: int = field(default=2048, metadata={"help": "tokens per prefill chunk inside a stage"})
    master_port: int = field(default=29512, metadata={"help": "torch.distributed rendezvous port "
                                                              "(MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE override)"})
    qat_sim: bool = field(default=True, metadata={"help": "the reference's fp8/fp4 activation simulations"})
    threads: int = field(default=0, metadata={"help": "CPU threads per stage process (0: cores / stages)"})

    def __post_init__(self):
        if self.pp < 1:
            raise ValueError(f"--pp must be >= 1, got {self.pp}")
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be in 1..65535, got {self.port}")
        if self.max_prompt_tokens < 1 or self.batch_tokens < self.max_prompt_tokens:
            raise ValueError(f"--batch-tokens ({self.batch_tokens}) must be >= --max-prompt-tokens "
                             f"({self.max_prompt_tokens}) >= 1")
        if self.chunk_tokens < 1:
            raise ValueError(f"--chunk-tokens must be >= 1, got {self.chunk_tokens}")


def split_layers(num_layers: int, stages: int, aux_layers: tuple[int, ...] = ()) -> list[range]:
    """Contiguous layer ranges, as even as possible, with every aux layer (DSpark context) on the last stage."""
    if stages > num_layers:
        raise ValueError(f"--pp {stages} exceeds the model's {num_layers} layers")
    bounds = [round(i * num_layers / stages) for i in range(stages + 1)]
    if aux_layers:
        bounds[-2] = min(bounds[-2], min(aux_layers))
        for i in range(stages - 2, 0, -1):
            bounds[i] = min(bounds[i], bounds[i + 1] - 1)
        if bounds[1] <= bounds[0]:
            raise ValueError(f"cannot place the DSpark aux layers {aux_layers} on the last of {stages} stages")
    return [range(bounds[i], bounds[i + 1]) for i in range(stages)]
