"""Shared checks for the deployment tests: the CLI's real flags and env names, and a checker of invocations."""

from __future__ import annotations

import dataclasses
import functools
import io
import os
import re
import subprocess
import sys
from pathlib import Path
from unittest import mock

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
        err = io.StringIO()
        try:
            parser = _parser()
            with mock.patch.object(sys, "stderr", new=err):
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
