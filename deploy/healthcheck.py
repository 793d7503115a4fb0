"""Container health check for the dspark-pd image (Docker HEALTHCHECK and compose `healthcheck`).

    python /opt/dspark/healthcheck.py [prefill|decode]

Finds the `dspark-pd serve-prefill` / `serve-decode` process in this container (its command line and DSPARK_*
environment), reads its host and port with the CLI's own parser, and probes the real endpoint:
  decode:  GET http://HOST:PORT/health answers 200 (the app is up: the model is loaded);
  prefill: the standard grpc.health.v1 Check on HOST:PORT answers SERVING (rank 0, the gRPC leader). A pipeline
           stage of rank > 0 has no endpoint: it is healthy while its process runs.
Exit 0: healthy, 1: not. With a role argument only a process of that role is considered (useful where the PID
namespace is shared with another container).
"""

from __future__ import annotations

import os
import sys
import urllib.request
from pathlib import Path

ROLES = {"serve-prefill": "prefill", "serve-decode": "decode"}


def find_server(role: str | None = None, proc: Path = Path("/proc")) -> tuple[list[str], dict[str, str]] | None:
    """(argv from the subcommand on, environment) of the serving process, or None."""
    for d in sorted(proc.glob("[0-9]*"), key=lambda p: int(p.name)):
        try:
            argv = [a.decode() for a in (d / "cmdline").read_bytes().split(b"\0") if a]
        except OSError:
            continue
        for i, a in enumerate(argv):
            if a in ROLES and (role is None or ROLES[a] == role):
                try:
                    raw = (d / "environ").read_bytes().split(b"\0")
                    env = dict(e.decode(errors="replace").split("=", 1) for e in raw if b"=" in e)
                except OSError:
                    env = dict(os.environ)
                return argv[i:], env
    return None


def target(argv: list[str], env: dict[str, str]) -> tuple[str, str, int, int]:
    """(role, host, port, rank) of a `serve-*` command line run with environment env, parsed as the CLI does."""
    from cli.main import _parser

    saved = {k: v for k, v in os.environ.items() if k.startswith("DSPARK_")}
    try:
        for k in saved:
            del os.environ[k]
        os.environ.update({k: v for k, v in env.items() if k.startswith("DSPARK_")})
        ns = _parser().parse_args(argv)
    finally:
        for k in [k for k in os.environ if k.startswith("DSPARK_")]:
            del os.environ[k]
        os.environ.update(saved)
    host = ns.host if ns.host not in ("", "0.0.0.0", "::") else "127.0.0.1"
    return ROLES[ns.command], host, ns.port, int(env.get("RANK", 0))


def probe_decode(host: str, port: int, timeout: float = 5.0) -> bool:
    h = f"[{host}]" if ":" in host else host
    try:
        with urllib.request.urlopen(f"http://{h}:{port}/health", timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


def probe_prefill(host: str, port: int, timeout: float = 5.0) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    h = f"[{host}]" if ":" in host else host
    try:
        with grpc.insecure_channel(f"{h}:{port}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                              timeout=timeout)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def main(args: list[str]) -> int:
    role = args[0] if args else None
    if role not in (None, "prefill", "decode"):
        print(f"usage: healthcheck.py [prefill|decode], got {role!r}", file=sys.stderr)
        return 2
    found = find_server(role)
    if found is None:
        print("no dspark-pd serve-prefill/serve-decode process", file=sys.stderr)
        return 1
    try:
        kind, host, port, rank = target(*found)
    except SystemExit:  # argparse rejected the command line: nothing to probe
        return 1
    if kind == "prefill" and rank != 0:
        return 0
    ok = probe_decode(host, port) if kind == "decode" else probe_prefill(host, port)
    print(f"{kind} {host}:{port} {'healthy' if ok else 'unhealthy'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
