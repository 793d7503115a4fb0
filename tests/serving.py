"""Helpers for tests that run the services as real processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "model" / "data" / "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Service:
    """A `dspark-pd` subcommand in its own process group, waited on until it prints `ready_text`."""

    def __init__(self, args: list[str], ready_text: str, timeout: float = 300, env: dict | None = None):
        self.log = Path(os.environ.get("TMPDIR", "/tmp")) / f"dspark-{os.getpid()}-{time.monotonic_ns()}.log"
        self.fh = open(self.log, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "cli.main", *args], stdout=self.fh,
                                     stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                                     env={**os.environ, "MC_LOG_LEVEL": "ERROR", **(env or {})})
        deadline = time.monotonic() + timeout
        while ready_text not in self.output():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{args[0]} did not start:\n{self.output()[-3000:]}")
            time.sleep(0.2)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()
        self.fh.close()


def start_prefill(pp: int, port: int | None = None, extra: list[str] = ()) -> tuple[Service, int]:
    port = port or free_port()
    svc = Service(["serve-prefill", "--model", str(TINY), "--pp", str(pp), "--port", str(port), "--threads", "1",
                   "--master-port", str(free_port()), "--max-prompt-tokens", "4096", "--batch-tokens", "8192",
                   *extra], "prefill service ready")
    return svc, port
