"""Draft proposers for speculative decoding.

A proposer is called, per engine step, in this order:
1. `extend_context(batch, aux, accepted)` after every target extend that committed tokens (prefill chunks and
   verification steps): the target streams `aux` at the proposer's layers, for the batch's new positions, of which
   the first accepted[b] were kept.
2. `propose(rows)` before verification: for each request, a block of `block_size` draft tokens following the anchor
   (the last sampled token, not yet in the target state), with the draft distribution each was drawn from.
Proposers hold no per-request Python state; their device state lives in the runner's cache pool, in the
request's slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model.drafter import Drafter
from model.target import StepBatch, Transformer

from .sampling import DRAFT, probs_from_logits, sample_from_probs


@dataclass(frozen=True, slots=True)
class DraftRows:
    """One padded batch of requests to draft for."""

    anchor: torch.Tensor  # [B] int64 last sampled token
    start: torch.Tensor  # [B] int64 tokens held in state (the anchor's position)
    slots: torch.Tensor  # [B] int64
    is_padding: torch.Tensor  # [B] bool
    temperature: torch.Tensor  # [B] fp32
    top_p: torch.Tensor  # [B] fp32
    seed: torch.Tensor  # [B] int64


@dataclass(frozen=True, slots=True)
class Draft:
    tokens: torch.Tensor  # [B, b] int64
    probs: torch.Tensor  # [B, b, V] fp32 distribution each token was drawn from
    confidence: torch.Tensor | None = None  # [B, b] fp32 estimated acceptance (DSpark's confidence head)


class Proposer:
    block_size: int
    capture: tuple[int, ...] = ()  # target layers whose streams `extend_context` needs
    layers: tuple[int, ...] = ()  # cache-pool layers (window rings) the proposer keeps per request

    def extend_context(self, pool, batch: StepBatch, aux: dict[int, torch.Tensor], accepted: torch.Tensor) -> None:
        raise NotImplementedError

    def propose(self, pool, rows: DraftRows) -> Draft:
        raise NotImplementedError


class DSparkProposer(Proposer):
    """The DSpark drafter: context KV from the target's aux layers, one parallel block forward, then left-to-right
    sampling with the Markov bias."""

    def __init__(self, drafter: Drafter, target: Transformer):
        self.drafter, self.target = drafter, target
        self.block_size = drafter.cfg.dspark_block_size
        self.capture = tuple(drafter.cfg.dspark_target_layer_ids)
        self.layers = tuple(drafter.layer_ids)

    @torch.inference_mode()
    def extend_context(self, pool, batch, aux, accepted):
        rows, memo = self.drafter.context_kv(aux, batch.positions), {}
        for layer, kv in zip(self.layers, rows):
            pool.commit_rows(layer, batch, kv, accepted, memo)

    @torch.inference_mode()
    def propose(self, pool, rows: DraftRows) -> Draft:
        w = self.drafter.cfg.sliding_window
        contexts = [pool.swa[layer][rows.slots, :w] for layer in self.layers]
        hidden = self.drafter.block_hidden(self.target.embed, rows.anchor, rows.start, contexts, rows.is_padding)
        base = self.drafter.base_logits(self.target.head, hidden)  # [B, b, V]
        markov, last = self.drafter.last.markov_head, self.drafter.last
        prev = rows.anchor
        tokens, probs, conf = [], [], []
        for i in range(self.block_size):
            logits = base[:, i] + markov.bias(prev)
            p = probs_from_logits(logits, rows.temperature, rows.top_p)
            tok = sample_from_probs(p, rows.seed, rows.start + i + 1, DRAFT)
            conf.append(last.confidence_head(hidden[:, i], markov.markov_w1(prev)))
            tokens.append(tok)
            probs.append(p)
            prev = tok
        return Draft(torch.stack(tokens, 1), torch.stack(probs, 1), torch.stack(conf, 1))


class ReplayProposer(Proposer):
    """Replays known continuations (e.g. the target's own greedy output from a non-speculative run), optionally
    corrupted at chosen (start, block index) positions: a drafter with forced full or partial acceptance, for tests
    and benchmarks. It rebuilds each slot's committed sequence from the batches it is shown (host-side, slow)."""

    def __init__(self, expected: dict[tuple, list[int]], block_size: int, vocab: int, corrupt=lambda start, i: False):
        self.expected, self.block_size, self.vocab, self.corrupt = expected, block_size, vocab, corrupt
        self.seq: dict[int, list[int]] = {}

    def extend_context(self, pool, batch, aux, accepted):
        for row, n in enumerate(accepted.tolist()):
            if batch.is_padding[row]:
                continue
            slot = int(batch.slots[row])
            if int(batch.start[row]) == 0:
                self.seq[slot] = []
            self.seq[slot] += batch.input_ids[row, :n].tolist()

    def propose(self, pool, rows):
        tokens = []
        for slot, anchor, start, pad in zip(rows.slots.tolist(), rows.anchor.tolist(), rows.start.tolist(),
                                            rows.is_padding.tolist()):
            if pad:
                tokens.append([0] * self.block_size)
                continue
            seq = self.seq[slot] + [anchor]
            prompt, cont = next((p, c) for p, c in self.expected.items() if tuple(seq[:len(p)]) == p)
            done = len(seq) - len(prompt)
            block = (cont[done:done + self.block_size] + [0] * self.block_size)[:self.block_size]
            tokens.append([(t + 1) % self.vocab if self.corrupt(start, i) else t for i, t in enumerate(block)])
        t = torch.tensor(tokens)
        return Draft(t, torch.nn.functional.one_hot(t, self.vocab).float())
