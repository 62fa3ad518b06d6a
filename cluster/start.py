"""`powerinfer ray-start`: `ray start` for a host of a PowerInfer cluster, with this host's NUMA
nodes advertised as custom resources (`numa_node_<i>`: its cores; model groups ask for them) and
Ray's token authentication on. Every other argument goes to `ray start` as it is:

    powerinfer ray-start --head --port 6379
    powerinfer ray-start --address HEAD:6379        # RAY_AUTH_TOKEN: the head's token
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from .topology import Topology, numa_resources


def ray_start_command(ray_args: list[str], topo: Topology | None = None) -> list[str]:
    """The `ray start` command line: the given arguments, with --resources holding the NUMA
    nodes merged with any resources given."""
    args, resources = list(ray_args), numa_resources(topo)
    for i, a in enumerate(args):
        if a == "--resources" or a.startswith("--resources="):
            value = args[i + 1] if a == "--resources" else a.split("=", 1)[1]
            resources.update(json.loads(value))
            del args[i:i + (2 if a == "--resources" else 1)]
            break
    return [str(Path(sys.executable).with_name("ray")), "start", *args,
            "--resources", json.dumps(resources)]


def add_command(sub):
    p = sub.add_parser("ray-start", help="ray start with this host's NUMA nodes as resources and "
                                         "token authentication on",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ray_args", nargs=argparse.REMAINDER, help="arguments for `ray start`")
    p.set_defaults(run=_run)


def _run(args) -> int:
    from powerinfer.compat import private_ray_token

    # (`ray start` wrote it readable by every user of the host)
    private_ray_token(create="--head" in args.ray_args)
    cmd = ray_start_command(args.ray_args)
    print(" ".join(cmd), flush=True)
    return subprocess.call(cmd, env={**os.environ, "RAY_AUTH_MODE": "token"})
