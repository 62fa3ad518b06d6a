"""Runtimes and commands built on this library, found through entry points of installed packages
(`pyproject.toml`: the actor runtime registers "actors" in `powerinfer.runtimes`, the server its
`serve` command in `powerinfer.commands`). The library itself never imports them: they depend on
it, not the other way round.
"""
from __future__ import annotations

from importlib.metadata import entry_points

from .errors import ConfigError

RUNTIMES, COMMANDS = "powerinfer.runtimes", "powerinfer.commands"


def engine_class(runtime: str):
    """The engine class of a registered runtime: built as cls(model_path, config), it offers
    generate/agenerate, tokenize, health, stats and shutdown (see actors/handle.py)."""
    found = {ep.name: ep for ep in entry_points(group=RUNTIMES)}
    if runtime not in found:
        raise ConfigError(f"runtime {runtime!r} is not installed (installed: "
                          f"{', '.join(sorted(found)) or 'none'}; 'local' is built in). Runtimes "
                          "register when their package is installed: for 'actors', this "
                          "project's (`pip install -e .` in its checkout, which `make setup` "
                          "does); a checkout on the import path alone registers none")
    return found[runtime].load()


def add_commands(subparsers):
    """Let every registered command add its subparser (its `run` default does the work)."""
    for ep in sorted(entry_points(group=COMMANDS), key=lambda e: e.name):
        ep.load()(subparsers)
