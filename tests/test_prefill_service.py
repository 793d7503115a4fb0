"""The prefill service as real processes (PP=1 and PP=2) with real Mooncake over TCP on 127.0.0.1: the bytes that
land equal the aggregated engine's state; failures give the stated gRPC status and the service keeps serving."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal

import grpc
import pytest
import torch

import model
from decode_service.kv_receiver import KVReceiver
from engine.runner import CacheSizing, ModelRunner
from model.checkpoint import load_drafter
from proto import prefill_pb2, prefill_pb2_grpc
from transfer.layout import region_layout
from transfer.mooncake import MooncakeEngine
from transfer.pack import pack_layer

from .serving import TINY, free_port, start_prefill

PROMPTS = [7, 40, 133, 301]


@pytest.fixture(scope="module", params=[1, 2], ids=["pp1", "pp2"])
def prefill(request):
    mport = free_port()
    svc, port = start_prefill(request.param, extra=["--metrics-port", str(mport)])
    svc.metrics_port = mport
    request.module.SERVICES[port] = svc
    yield port
    svc.stop()


SERVICES = {}


@pytest.fixture(scope="module")
def receiver():
    cfg = model.load_config(TINY)
    return KVReceiver(cfg, torch.float32, MooncakeEngine("127.0.0.1"), 32 << 20)


@pytest.fixture(scope="module")
def reference():
    """The aggregated engine's state after each prompt, packed with the same layout (one thread, like the
    service's stages, so the float reductions are the same)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    target = model.load(TINY, dtype=torch.float32)
    ctx = load_drafter(TINY, dtype=torch.float32, context_only=True)
    runner = ModelRunner(target, CacheSizing(max_requests=1, max_tokens=1024, block_size=64), ctx.layer_ids)
    out = {}
    for n in PROMPTS:
        ids = _prompt(n)
        rc = runner.new_request()
        batch = runner.batch([(rc, ids)])
        res = runner.extend(batch, capture=tuple(target.cfg.dspark_target_layer_ids))
        runner.commit([rc], batch, res, [n])
        for layer, rows in zip(ctx.layer_ids, ctx(res.aux, batch.positions)):
            runner.pool.commit_rows(layer, batch, rows, torch.tensor([n]))
        first = int(target.logits(res.streams[:, -1]).argmax())
        packed = {}
        for layer in list(range(target.cfg.num_hidden_layers)) + ctx.layer_ids:
            lay = region_layout(target.cfg, layer, n, torch.float32)
            buf = torch.zeros(lay.nbytes, dtype=torch.uint8)
            r = target.cfg.ratio(layer) if layer < target.cfg.num_hidden_layers else 0
            pack_layer(runner.pool, lay, rc.slot, rc.tables.get(r, []), buf)
            packed[layer] = buf
        out[n] = (first, packed)
        runner.release(rc)
    torch.set_num_threads(threads)
    return out


def _prompt(n: int) -> list[int]:
    return [(i * 37 + n) % 990 + 6 for i in range(n)]


def _request(rx, res, ids, rid, layout_hash, **kw):
    return prefill_pb2.PrefillRequest(request_id=rid, token_ids=ids, layout_hash=layout_hash,
                                      sampling=prefill_pb2.Sampling(temperature=0.0, top_p=1.0),
                                      destination=kw.pop("destination", None) or rx.destination(res), **kw)


async def _stub(port):
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = prefill_pb2_grpc.PrefillServiceStub(ch)
    return ch, stub, (await stub.GetInfo(prefill_pb2.InfoRequest())).layout_hash


def test_landed_bytes_equal_the_aggregated_state(prefill, receiver, reference):
    async def main():
        ch, stub, h = await _stub(prefill)
        res = {n: receiver.reserve(n, 60) for n in PROMPTS}
        calls = [stub.Prefill(_request(receiver, res[n], _prompt(n), f"eq-{n}", h), timeout=60) for n in PROMPTS]
        replies = await asyncio.gather(*calls)
        await ch.close()
        return res, replies

    res, replies = asyncio.run(main())
    for n, rep in zip(PROMPTS, replies):
        first, packed = reference[n]
        assert rep.first_token == first
        assert rep.bytes_moved == sum(b.numel() for b in packed.values())
        for layer, want in packed.items():
            got = receiver.region(res[n], layer)
            assert torch.equal(got, want), str((n, layer, _debug(receiver, res[n], reference, n, layer)))
        receiver.release(res[n], safe=True)


def test_metrics_are_served(prefill):
    import re
    import urllib.request
    text = urllib.request.urlopen(f"http://127.0.0.1:{SERVICES[prefill].metrics_port}/metrics").read().decode()
    tokens = float(re.search(r"^prefill_tokens_total ([0-9.e+]+)$", text, re.M).group(1))
    assert tokens >= sum(PROMPTS)  # the equality test's prompts were counted
    assert re.search(r'^prefill_requests_total\{outcome="ok"\} [1-9]', text, re.M)
    assert re.search(r"^prefill_transfer_bytes_total [1-9]", text, re.M)


def _status(coro):
    async def run():
        try:
            await coro
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details()
        return grpc.StatusCode.OK, ""
    return run()


def test_malformed_requests_are_refused_and_service_continues(prefill, receiver, reference):
    async def main():
        ch, stub, h = await _stub(prefill)
        res = receiver.reserve(40, 60)
        dest = receiver.destination(res)
        short = prefill_pb2.Destination(session=dest.session, regions=list(dest.regions)[:-1])
        wrong = prefill_pb2.Destination(session=dest.session, regions=[
            prefill_pb2.Region(layer=r.layer, address=r.address, nbytes=r.nbytes + 8) for r in dest.regions])
        cases = {
            "token_ids is empty": _request(receiver, res, [], "m1", h),
            "outside the vocabulary": _request(receiver, res, [5, 100000] + [7] * 38, "m2", h),
            "exceeds max_prompt_tokens": _request(receiver, res, [7] * 5000, "m3", h),
            "cover layers": _request(receiver, res, _prompt(40), "m4", h, destination=short),
            "the layout needs": _request(receiver, res, _prompt(40), "m5", h, destination=wrong),
            "is not 'ip:port'": _request(receiver, res, _prompt(40), "m6", h,
                                         destination=prefill_pb2.Destination(session="nowhere")),
        }
        out = {k: await _status(stub.Prefill(r, timeout=30)) for k, r in cases.items()}
        mismatch = await _status(stub.Prefill(_request(receiver, res, _prompt(40), "m7", "deadbeef"), timeout=30))
        ok = await stub.Prefill(_request(receiver, res, _prompt(40), "m8", h), timeout=30)
        await ch.close()
        return out, mismatch, ok, res, h

    out, mismatch, ok, res, h = asyncio.run(main())
    for text, (code, details) in out.items():
        assert code == grpc.StatusCode.INVALID_ARGUMENT and text in details, (text, code, details)
    assert mismatch[0] == grpc.StatusCode.FAILED_PRECONDITION
    assert "deadbeef" in mismatch[1] and h in mismatch[1]
    assert ok.first_token == reference[40][0]
    assert torch.equal(receiver.region(res, 0), reference[40][1][0])
    receiver.release(res, safe=True)


def test_unreachable_destination_is_unavailable(prefill, receiver):
    async def main():
        ch, stub, h = await _stub(prefill)
        res = receiver.reserve(40, 60)
        dest = receiver.destination(res)
        dead = prefill_pb2.Destination(session="127.0.0.1:9", regions=list(dest.regions))
        code = await _status(stub.Prefill(_request(receiver, res, _prompt(40), "u1", h, destination=dead),
                                          timeout=30))
        ok = await stub.Prefill(_request(receiver, res, _prompt(40), "u2", h), timeout=30)
        await ch.close()
        receiver.release(res, safe=True)
        return code, ok

    (code, details), ok = asyncio.run(main())
    assert code == grpc.StatusCode.UNAVAILABLE and "127.0.0.1:9" in details
    assert ok.bytes_moved > 0


def _dying_receiver(conn, tokens):
    cfg = model.load_config(TINY)
    rx = KVReceiver(cfg, torch.float32, MooncakeEngine("127.0.0.1"), 32 << 20)
    conn.send(rx.destination(rx.reserve(tokens, 60)).SerializeToString())
    conn.recv()  # killed while waiting here


def test_receiver_dying_mid_request_is_unavailable(prefill, receiver):
    n = 3000
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_dying_receiver, args=(child, n), daemon=True)
    proc.start()
    dest = prefill_pb2.Destination.FromString(parent.recv())

    async def main():
        ch, stub, h = await _stub(prefill)
        call = asyncio.ensure_future(stub.Prefill(_request(receiver, None, _prompt(n), "d1", h, destination=dest),
                                                  timeout=60))
        await asyncio.sleep(0.15)  # validated and probed; now computing
        proc.kill()
        code = await _status(call)
        res = receiver.reserve(40, 60)
        ok = await stub.Prefill(_request(receiver, res, _prompt(40), "d2", h), timeout=30)
        receiver.release(res, safe=True)
        await ch.close()
        return code, ok

    (code, details), ok = asyncio.run(main())
    assert code == grpc.StatusCode.UNAVAILABLE, details
    assert ok.bytes_moved > 0


def test_cancel_mid_flight(prefill, receiver):
    async def main():
        ch, stub, h = await _stub(prefill)
        res = receiver.reserve(3000, 60)
        call = asyncio.ensure_future(stub.Prefill(_request(receiver, res, _prompt(3000), "c1", h), timeout=60))
        await asyncio.sleep(0.1)
        ack = await stub.Cancel(prefill_pb2.CancelRequest(request_id="c1"), timeout=60)
        code = await _status(call)
        unknown = await stub.Cancel(prefill_pb2.CancelRequest(request_id="never"), timeout=10)
        res2 = receiver.reserve(40, 60)
        ok = await stub.Prefill(_request(receiver, res2, _prompt(40), "c2", h), timeout=30)
        await ch.close()
        receiver.release(res, safe=True)
        receiver.release(res2, safe=True)
        return ack, code, unknown, ok

    ack, (code, _), unknown, ok = asyncio.run(main())
    assert ack.found and code == grpc.StatusCode.CANCELLED
    assert not unknown.found and ok.bytes_moved > 0


def test_deadline_exceeded(prefill, receiver):
    async def main():
        ch, stub, h = await _stub(prefill)
        res = receiver.reserve(3000, 60)
        code = await _status(stub.Prefill(_request(receiver, res, _prompt(3000), "t1", h), timeout=0.05))
        await asyncio.sleep(3)  # let the service finish (or drop) it before the slice is reused
        await ch.close()
        receiver.release(res, safe=True)
        return code

    assert asyncio.run(main())[0] == grpc.StatusCode.DEADLINE_EXCEEDED


def _debug(receiver, res, reference, n, layer):
    from transfer.pack import piece_view
    lay = region_layout(receiver.cfg, layer, n, torch.float32)
    got, want = receiver.region(res, layer), reference[n][1][layer]
    return {p.name: float((piece_view(got, lay, p.name).float() - piece_view(want, lay, p.name).float()).abs().max())
            for p in lay.pieces}


def test_multi_node_rendezvous_through_env(receiver, reference):
    """Stages started separately with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT (as on Kubernetes, one pod per rank)
    form one pipeline; rank 0 serves gRPC."""
    from .serving import Service

    port, master = free_port(), free_port()
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master)}
    args = ["serve-prefill", "--model", str(TINY), "--port", str(port), "--threads", "1",
            "--max-prompt-tokens", "4096", "--batch-tokens", "8192"]
    import subprocess
    import sys
    worker = subprocess.Popen([sys.executable, "-m", "cli.main", *args], env={**__import__("os").environ, **env,
                              "RANK": "1", "MC_LOG_LEVEL": "ERROR"}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    leader = Service(args, "prefill service ready", env={**env, "RANK": "0"})
    try:
        async def main():
            ch, stub, h = await _stub(port)
            info = await stub.GetInfo(prefill_pb2.InfoRequest())
            res = receiver.reserve(40, 60)
            rep = await stub.Prefill(_request(receiver, res, _prompt(40), "mn1", h), timeout=60)
            await ch.close()
            return info, rep, res
        info, rep, res = asyncio.run(main())
        assert [(s.first_layer, s.last_layer) for s in info.stages] == [(0, 3), (3, 6)]
        assert rep.first_token == reference[40][0]
        assert torch.equal(receiver.region(res, 5), reference[40][1][5])
        receiver.release(res, safe=True)
    finally:
        leader.stop()
        worker.kill()
        worker.wait()


def test_a_dead_stage_takes_the_service_down_for_a_restart():
    """A stage process killed (OOM killer, crash): the leader cannot mend the pipeline in place, so it stops
    answering and exits with code 3 (a supervisor restarts it; decode sees the peer go away) instead of staying
    "ready" and failing every request."""
    import pathlib

    svc, _ = start_prefill(2)
    try:
        children = pathlib.Path(f"/proc/{svc.proc.pid}/task/{svc.proc.pid}/children").read_text().split()
        stages = [int(c) for c in children
                  if "spawn_main" in pathlib.Path(f"/proc/{c}/cmdline").read_bytes().decode(errors="replace")]
        assert len(stages) == 1
        os.kill(stages[0], signal.SIGKILL)
        assert svc.proc.wait(timeout=30) == 3
        assert "prefill pipeline broken" in svc.output()
    finally:
        svc.stop()
