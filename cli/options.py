"""Command-line options generated from frozen config dataclasses.

Each field becomes `--field-name` with its default, its docstring-like `help` metadata, and an environment variable
`DSPARK_FIELD_NAME` that overrides the default (read here, in one place).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing


def env_name(field: str) -> str:
    return "DSPARK_" + field.upper()


def add_options(parser: argparse.ArgumentParser, cls: type, positional: tuple[str, ...] = ()) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        typ = hints[f.name]
        default = f.default if f.default is not dataclasses.MISSING else None
        env = os.environ.get(env_name(f.name))
        help_text = f.metadata.get("help", "")
        if f.name in positional:
            parser.add_argument(f.name, help=f"{help_text} [env {env_name(f.name)}]", nargs="?" if env else None,
                                default=env)
            continue
        flag = "--" + f.name.replace("_", "-")
        choices = f.metadata.get("choices")
        if typ is bool:
            value = default if env is None else env.lower() in ("1", "true", "yes", "on")
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=value,
                                help=f"{help_text} (default: {value}) [env {env_name(f.name)}]")
            continue
        conv = _converter(typ)
        value = conv(env) if env is not None else default
        required = value is None and f.default is dataclasses.MISSING
        shown = "required" if required else f"default: {value}"
        parser.add_argument(flag, type=conv, default=value, choices=choices, required=required,
                            help=f"{help_text} ({shown}) [env {env_name(f.name)}]")


def _converter(typ):
    args = typing.get_args(typ)
    if args:  # Optional[X]
        typ = next(a for a in args if a is not type(None))
    return typ if typ in (int, float, str) else str


def build(cls: type, ns: argparse.Namespace):
    """Construct cls from parsed options (its __post_init__ validates and raises ValueError naming values)."""
    return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})
