"""The `dspark-pd` command line as a user runs it (subprocesses), and the bundled checkpoint."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from model.synthetic import make_checkpoint

BUNDLED = Path(__file__).resolve().parent.parent / "model" / "data" / "tiny"


def dspark(*args, env=None):
    return subprocess.run([sys.executable, "-m", "cli.main", *args], capture_output=True, text=True, timeout=120,
                          env=env)


def test_bundled_checkpoint_is_the_generator_output(tmp_path):
    make_checkpoint("tiny", tmp_path, layout="official", fmt="bf16", seed=0)
    for f in BUNDLED.iterdir():
        assert f.read_bytes() == (tmp_path / f.name).read_bytes(), f"{f.name} differs: regenerate model/data/tiny"


def test_generate_streams_text_and_reports():
    r = dspark("generate", "--prompt", "Hello there", "--max-tokens", "12")
    assert r.returncode == 0, r.stderr
    assert "12 generated" in r.stderr and "finish: length" in r.stderr
    assert r.stdout.strip()


def test_generate_greedy_is_deterministic():
    a = dspark("generate", "--max-tokens", "8")
    b = dspark("generate", "--max-tokens", "8")
    assert a.stdout == b.stdout


def test_help_lists_flags_with_defaults_and_env():
    r = dspark("generate", "--help")
    assert r.returncode == 0
    for flag in ("--max-tokens", "--temperature", "--top-p", "--seed", "--model", "DSPARK_MAX_TOKENS"):
        assert flag in r.stdout
    assert "default: 64" in r.stdout


def test_env_sets_defaults(tmp_path):
    import os
    r = dspark("generate", "--max-tokens", "3", env={**os.environ, "DSPARK_PROMPT": "from env"})
    assert r.returncode == 0 and "3 generated" in r.stderr


def test_bad_values_give_clear_errors(tmp_path):
    r = dspark("generate", "--max-tokens", "0")
    assert r.returncode == 2 and "max-tokens must be >= 1" in r.stderr
    r = dspark("generate", "--model", str(tmp_path))
    assert r.returncode == 2 and "config.json" in r.stderr
    r = dspark("make-checkpoint", "--preset", "huge", str(tmp_path))
    assert r.returncode == 2 and "invalid choice" in r.stderr
    r = dspark("serve-decode", "--model", "model/data/tiny", "--switch-interval-ms", "0")
    assert r.returncode == 2 and "--switch-interval-ms must be > 0" in r.stderr


def test_bench_subcommand_runs_a_benchmark():
    r = dspark("bench", "spec_cpu", "--requests", "1", "--prompt", "8", "--max-tokens", "6")
    assert r.returncode == 0, r.stderr
    assert "forced acceptance" in r.stdout and "accept len" in r.stdout


def test_up_stops_both_services_on_sigterm():
    """`dspark-pd up` under docker stop / systemd / timeout gets SIGTERM, not Ctrl-C: the services (in their own
    sessions) must go with it."""
    import os
    import re
    import signal
    import socket
    import time

    up = subprocess.Popen([sys.executable, "-m", "cli.main", "up", "--pp", "1", "--port", "0", "--device", "cpu"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env={**os.environ, "MC_LOG_LEVEL": "ERROR"})
    try:
        port = None
        for line in up.stdout:
            m = re.search(r"ready: OpenAI API at http://127\.0\.0\.1:(\d+)/v1", line)
            if m:
                port = int(m.group(1))
                break
        assert port, "up never became ready"
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0
        end = time.monotonic() + 30
        while time.monotonic() < end:  # the decode service's port closes once it has exited
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) != 0:
                    break
            time.sleep(0.5)
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0, "the decode service outlived `up`"
    finally:
        if up.poll() is None:
            up.kill()


def test_demo_metrics_table_counts_requests_of_any_outcome(capsys):
    from cli.pair import _print_metrics

    _print_metrics('requests_total{outcome="length"} 4.0\nttft_seconds_sum 0.4\nttft_seconds_count 4.0\n')
    out = capsys.readouterr().out
    assert "requests" in out and " 4.00" in out and "100.00 ms" in out
