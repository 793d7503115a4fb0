"""`dspark-pd up` (prefill + decode on this machine, until Ctrl-C) and `dspark-pd demo` (the pair on the bundled tiny
checkpoint, a few chat requests through the official `openai` client, a small metrics table)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from .generate import BUNDLED_TINY


@dataclass(frozen=True, slots=True)
class UpConfig:
    model: str = field(default=str(BUNDLED_TINY), metadata={"help": "checkpoint directory"})
    pp: int = field(default=2, metadata={"help": "prefill pipeline stages"})
    port: int = field(default=8000, metadata={"help": "HTTP port of the decode service (0: any free port)"})
    spec: bool = field(default=True, metadata={"help": "DSpark speculative decoding on the decode side"})
    device: str = field(default="auto", metadata={"help": "cpu, cuda or auto"})
    startup_timeout_s: float = field(default=300.0, metadata={"help": "how long to wait for readiness"})

    def __post_init__(self):
        if self.pp < 1:
            raise ValueError(f"--pp must be >= 1, got {self.pp}")


@dataclass(frozen=True, slots=True)
class DemoConfig:
    pp: int = field(default=2, metadata={"help": "prefill pipeline stages"})
    max_tokens: int = field(default=32, metadata={"help": "tokens per answer"})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Pair:
    """Prefill and decode as child processes (own process groups), ready when entered, stopped when left."""

    def __init__(self, cfg: UpConfig, log_dir: Path):
        self.cfg, self.log_dir = cfg, log_dir
        self.grpc_port, self.http_port = _free_port(), cfg.port or _free_port()
        self.procs: list[subprocess.Popen] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def _start(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "w")
        p = subprocess.Popen([sys.executable, "-m", "cli.main", *args], stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True, env={**os.environ, "MC_LOG_LEVEL": "ERROR"},
                             cwd=Path(__file__).resolve().parent.parent)
        self.procs.append(p)
        return p

    def __enter__(self) -> "Pair":
        # SIGTERM (docker stop, systemd, timeout) and SIGHUP stop the pair like Ctrl-C: the services run in their
        # own sessions, so nothing else would stop them
        self._handlers = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
        c = self.cfg
        threads = str(max(1, (os.cpu_count() or 2) // (c.pp + 1)))
        print(f"starting prefill ({c.pp} stage(s)) on :{self.grpc_port} ...", flush=True)
        self._start("prefill", ["serve-prefill", "--model", c.model, "--pp", str(c.pp), "--port",
                                str(self.grpc_port), "--device", c.device, "--master-port", str(_free_port()),
                                "--threads", threads])
        print(f"starting decode on :{self.http_port} ...", flush=True)
        self._start("decode", ["serve-decode", "--model", c.model, "--prefill", f"127.0.0.1:{self.grpc_port}",
                               "--port", str(self.http_port), "--device", c.device, "--threads", threads,
                               "--spec" if c.spec else "--no-spec"])
        try:
            self._wait_ready()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while time.monotonic() < deadline:
            for name, p in zip(("prefill", "decode"), self.procs):
                if p.poll() is not None:
                    tail = (self.log_dir / f"{name}.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"the {name} service exited with code {p.returncode}:\n{tail}")
            try:
                with urllib.request.urlopen(f"{self.url}/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"the pair was not ready after {self.cfg.startup_timeout_s:.0f}s (logs in {self.log_dir})")

    def __exit__(self, *exc) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        for sig, handler in getattr(self, "_handlers", {}).items():
            signal.signal(sig, handler)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


def up(cfg: UpConfig) -> int:
    log_dir = Path(tempfile.mkdtemp(prefix="dspark-pd-"))
    try:  # around the whole pair: Ctrl-C or SIGTERM may come during startup or right after "ready"
        with Pair(cfg, log_dir) as pair:
            print(f"ready: OpenAI API at {pair.url}/v1 (logs in {log_dir}); Ctrl-C stops both services", flush=True)
            while all(p.poll() is None for p in pair.procs):
                time.sleep(0.5)
            print("a service exited; stopping", file=sys.stderr)
            return 1
    except KeyboardInterrupt:
        print("\nstopping", flush=True)
    return 0


QUESTIONS = ["Hello! How are you today?", "Please explain the idea in simple words.",
             "Write a short poem about the sea.", "What is the capital of the small country?"]


def demo(cfg: DemoConfig) -> int:
    import logging

    import openai

    logging.getLogger().setLevel(logging.WARNING)  # keep the demo output readable
    log_dir = Path(tempfile.mkdtemp(prefix="dspark-pd-demo-"))
    with Pair(UpConfig(pp=cfg.pp, port=0), log_dir) as pair:
        client = openai.OpenAI(base_url=f"{pair.url}/v1", api_key="unused")
        name = client.models.list().data[0].id
        print(f"\nmodel {name} served at {pair.url}/v1 (a random-weight checkpoint: the words are noise)\n")
        for q in QUESTIONS[:-1]:
            r = client.chat.completions.create(model=name, messages=[{"role": "user", "content": q}],
                                               max_tokens=cfg.max_tokens, temperature=0)
            print(f"user> {q}\nassistant> {r.choices[0].message.content!r}  [{r.usage.completion_tokens} tokens, "
                  f"{r.choices[0].finish_reason}]\n")
        print(f"user> {QUESTIONS[-1]}  (streaming)\nassistant> ", end="", flush=True)
        stream = client.chat.completions.create(model=name, messages=[{"role": "user", "content": QUESTIONS[-1]}],
                                                max_tokens=cfg.max_tokens, temperature=0, stream=True)
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                print(chunk.choices[0].delta.content, end="", flush=True)
        print("\n")
        with urllib.request.urlopen(f"{pair.url}/metrics") as r:
            _print_metrics(r.read().decode())
    return 0


def _print_metrics(text: str) -> None:
    def value(name: str) -> float:
        m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
        return float(m.group(1)) if m else float("nan")

    finished = sum(float(v) for v in re.findall(r'^requests_total\{outcome="[^"]*"\} ([0-9.e+-]+)$', text, re.M))
    rows = [("requests", finished, ""),  # by outcome; an outcome that never happened has no line
            ("mean TTFT", value("ttft_seconds_sum") / value("ttft_seconds_count") * 1e3, "ms"),
            ("mean inter-token latency", value("inter_token_latency_seconds_sum") /
             value("inter_token_latency_seconds_count") * 1e3, "ms"),
            ("mean acceptance length", value("acceptance_length_sum") / value("acceptance_length_count"), "tokens"),
            ("KV bytes received", value("kv_transfer_bytes_total"), "B"),
            ("mean KV hand-off (prefill RPC)", value("kv_handoff_seconds_sum") / value("kv_handoff_seconds_count")
             * 1e3, "ms")]
    print(f"{'metric':<32}{'value':>14}")
    for name, v, unit in rows:
        print(f"{name:<32}{v:>14.2f} {unit}")
