"""`dspark-pd`: subcommands for checkpoints, generation and the serving pair."""

from __future__ import annotations

import argparse
import logging
import runpy
import sys
from pathlib import Path

from . import options
from .checkpoint import MakeCheckpointConfig
from .generate import GenerateConfig
from .pair import DemoConfig, UpConfig

BENCH = Path(__file__).resolve().parent.parent / "bench"  # present in a source checkout, not in a wheel
from decode_service.config import DecodeConfig
from prefill_service.config import PrefillConfig


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dspark-pd", description=__doc__.split(":", 1)[1].strip())
    p.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")
    sub = p.add_subparsers(dest="command", required=True)
    mk = sub.add_parser("make-checkpoint", help="write a deterministic random checkpoint")
    options.add_options(mk, MakeCheckpointConfig, positional=("out",))
    gen = sub.add_parser("generate", help="stream text from the aggregated engine")
    options.add_options(gen, GenerateConfig)
    pre = sub.add_parser("serve-prefill", help="run the pipeline-parallel gRPC prefill service")
    options.add_options(pre, PrefillConfig)
    dec = sub.add_parser("serve-decode", help="run the OpenAI-compatible decode service")
    options.add_options(dec, DecodeConfig)
    upp = sub.add_parser("up", help="start prefill and decode on this machine (Ctrl-C stops both)")
    options.add_options(upp, UpConfig)
    dem = sub.add_parser("demo", help="the pair on the bundled tiny checkpoint, a few chat requests, metrics")
    options.add_options(dem, DemoConfig)
    ben = sub.add_parser("bench", help="run a benchmark from bench/ (options after the name go to it; try --help)")
    ben.add_argument("name", choices=sorted(p.stem for p in BENCH.glob("*.py")), help="which benchmark")
    ben.add_argument("args", nargs=argparse.REMAINDER, help="its options")
    return p


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if ns.command == "make-checkpoint":
            from .checkpoint import run
            return run(options.build(MakeCheckpointConfig, ns))
        if ns.command == "generate":
            from .generate import run
            return run(options.build(GenerateConfig, ns))
        if ns.command == "bench":
            sys.argv = [str(BENCH / f"{ns.name}.py"), *ns.args]
            runpy.run_path(sys.argv[0], run_name="__main__")
            return 0
        if ns.command == "up":
            from .pair import up
            return up(options.build(UpConfig, ns))
        if ns.command == "demo":
            from .pair import demo
            return demo(options.build(DemoConfig, ns))
        if ns.command == "serve-decode":
            from decode_service.serve import serve
            return serve(options.build(DecodeConfig, ns), ns.log_level.upper())
        if ns.command == "serve-prefill":
            from prefill_service.server import serve
            return serve(options.build(PrefillConfig, ns), ns.log_level.upper())
    except (ValueError, FileNotFoundError, RuntimeError, TimeoutError) as e:
        print(f"dspark-pd {ns.command}: error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
