"""Prometheus metrics of the decode service (one registry per app)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class DecodeMetrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram("ttft_seconds", "time to first token", buckets=LATENCY, registry=r)
        self.itl = Histogram("inter_token_latency_seconds", "time between streamed tokens", buckets=LATENCY,
                             registry=r)
        self.e2e = Histogram("e2e_latency_seconds", "request latency", buckets=LATENCY, registry=r)
        self.acceptance = Histogram("acceptance_length", "tokens emitted per decode step (per request)",
                                    buckets=(1, 1.5, 2, 2.5, 3, 3.5, 4, 4.5, 5, 6, 8), registry=r)
        self.kv_bytes = Counter("kv_transfer_bytes", "bytes of request state received from prefill", registry=r)
        self.kv_seconds = Histogram("kv_handoff_seconds", "prefill RPC time (compute + transfer)", buckets=LATENCY,
                                    registry=r)
        self.requests = Counter("requests", "finished requests by outcome", ["outcome"], registry=r)
        self.generated = Counter("generated_tokens", "completion tokens", registry=r)
        self.running = Gauge("running_requests", "requests holding cache", registry=r)
        self.waiting = Gauge("waiting_requests", "requests waiting for admission", registry=r)
        self.free_slots = Gauge("free_cache_slots", "free request slots in the decode cache", registry=r)
        self.free_arena = Gauge("free_arena_bytes", "free bytes in the receive arena", registry=r)
        self.quarantined = Gauge("quarantined_regions", "arena slices waiting until no late write can land",
                                 registry=r)

    def finished(self, req) -> None:
        """Called on the engine thread when a request ends."""
        if req.steps > 1:  # the first token came from prefill, not from a decode step
            self.acceptance.observe((len(req.output_ids) - 1) / (req.steps - 1))
