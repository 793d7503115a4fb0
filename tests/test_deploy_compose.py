"""docker-compose files: the compose specification schema and commands, env and ports against the CLI."""

from __future__ import annotations

import copy
import functools
import importlib.resources
import importlib.util
import json
import os
import re

import jsonschema
import pytest
import yaml

from .deploy_checks import (
    COMPOSE_FILES,
    COMPOSE_VARS,
    DEPLOY,
    check_invocation,
    settings,
)

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
