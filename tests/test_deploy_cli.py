"""The CLI as the deployment files see it: help text and dataclasses agree; the invocation checker works;
deploy/README.md lists every setting."""

from __future__ import annotations

import dataclasses
import importlib.resources
import importlib.util
from pathlib import Path

import pytest

from cli import options

from .deploy_checks import (
    CONFIGS,
    DEPLOY,
    OTHER_ENV,
    ROOT,
    check_invocation,
    fields,
    help_env,
    help_flags,
)


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
# deploy/README.md
# ---------------------------------------------------------------------------------------------------------------

def test_readme_lists_every_setting_with_its_flag_and_default():
    text = (DEPLOY / "README.md").read_text()
    for sub, cls in CONFIGS.items():
        section = next(part for part in text.split("\n#### ") if part.split("\n", 1)[0].count(f"`dspark-pd {sub}`"))
        for f in dataclasses.fields(cls):
            default = "(required)" if f.default is dataclasses.MISSING else repr(f.default) if f.default == "" \
                else str(f.default)
            row = f"| `{options.env_name(f.name)}` | `--{f.name.replace('_', '-')}` | `{default}` |"
            assert row in section, f"{sub}: README lacks {row}"
    for name in OTHER_ENV:
        assert f"`{name}`" in text, name
