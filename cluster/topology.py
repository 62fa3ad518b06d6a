"""Host topology from sysfs (NUMA nodes and their cores) and the core sets a model's actors are
pinned to.

Only cores this process may run on count (`os.sched_getaffinity`: containers and cgroups
often allow fewer than the machine has).
"""
from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from pathlib import Path

from powerinfer.compat import process_memory  # noqa: F401 - re-exported: the actors read it here

SYS_NODE = Path("/sys/devices/system/node")


def parse_cpulist(text: str) -> list[int]:
    """"0-3,8,10-11" -> [0, 1, 2, 3, 8, 10, 11]"""
    out = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def format_cpulist(cores) -> str:
    """[0, 1, 2, 3, 8, 10, 11] -> "0-3,8,10-11" (parse_cpulist's inverse)"""
    out = []
    # (consecutive cores have the same difference from their index in the sorted list)
    for _, run in itertools.groupby(enumerate(sorted(cores)), lambda ic: ic[1] - ic[0]):
        run = [c for _, c in run]
        out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ",".join(out)


@dataclass(frozen=True)
class Topology:
    nodes: tuple[tuple[int, ...], ...]  # per NUMA node, the usable cores

    @classmethod
    def read(cls, sys_node: Path = SYS_NODE) -> "Topology":
        allowed = os.sched_getaffinity(0)
        nodes = []
        for d in sorted(sys_node.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
            cores = tuple(c for c in parse_cpulist((d / "cpulist").read_text()) if c in allowed)
            if cores:
                nodes.append(cores)
        if not nodes:  # no NUMA information (some containers): one node of the allowed cores
            nodes = [tuple(sorted(allowed))]
        return cls(tuple(nodes))

    @property
    def cores(self) -> list[int]:
        return [c for n in self.nodes for c in n]

    def within(self, cores: list[int]) -> "Topology":
        """The same nodes, keeping only `cores` (nodes left empty are dropped)."""
        keep = set(cores)
        nodes = tuple(tuple(c for c in n if c in keep) for n in self.nodes)
        nodes = tuple(n for n in nodes if n)
        if not nodes:
            raise ValueError(f"none of the cores {sorted(keep)} is usable here "
                             f"(usable: {self.cores})")
        return Topology(nodes)


@dataclass(frozen=True)
class CorePlan:
    hot: tuple[int, ...]
    cold: tuple[tuple[int, ...], ...]  # one core set per cold executor
    predictor: tuple[int, ...]

    def describe(self) -> str:
        return (f"hot {list(self.hot)}; cold " + ", ".join(str(list(c)) for c in self.cold)
                + f"; predictor {list(self.predictor)}")


def plan_cores(topo: Topology, n_cold: int, hot_cores: int = 0) -> CorePlan:
    """Core sets for the hot executor and n_cold cold executors (none: the hot executor runs
    the whole model on every core).

    The hot executor takes `hot_cores` cores of node 0 (default: a 1/(n_cold+1) share, at least
    one). Cold executors split the rest node by node, so that with one executor per NUMA node
    each owns a whole node and its local memory; with more executors than cores they share
    cores. The predictor runs on the cold executors' cores (it works while they wait for
    attention to finish); the scheduler is not pinned.
    """
    cores = topo.cores
    if n_cold == 0:  # one executor, every core (`Config(cold_executors=0)`)
        return CorePlan(tuple(cores), (), ())
    k = hot_cores or max(1, len(cores) // (n_cold + 1))
    hot = tuple(cores[:k]) if len(cores) > 1 else tuple(cores)
    rest = [c for c in cores if c not in hot] or cores
    nodes = [[c for c in n if c in rest] for n in topo.nodes]
    nodes = [n for n in nodes if n]
    if n_cold <= len(nodes):  # whole nodes, the last executor takes what is left
        groups = [tuple(n) for n in nodes[:n_cold - 1]] + [tuple(c for n in nodes[n_cold - 1:] for c in n)]
    elif n_cold <= len(rest):  # contiguous slices, node order kept
        q, r = divmod(len(rest), n_cold)
        groups, at = [], 0
        for i in range(n_cold):
            size = q + (i < r)
            groups.append(tuple(rest[at:at + size]))
            at += size
    else:  # more executors than cores: one core each, shared round-robin
        groups = [(rest[i % len(rest)],) for i in range(n_cold)]
    pred = tuple(sorted({c for g in groups for c in g}))
    return CorePlan(hot, tuple(groups), pred)


def pin(cores: tuple[int, ...], threads: int = 0) -> None:
    """Pin this process, every thread it has and the threads they start later (torch's workers),
    to cores, and size torch's thread pool to them (or to `threads`, at most one per core). Call
    on the thread that will compute (an actor's `roles._Role.compute`: the pool's size is that
    thread's), before allocating the memory the process will work on, so that first touch places
    it on the local node."""
    import torch
    pin_threads(cores)  # (sched_setaffinity of pid 0 would pin the calling thread only)
    torch.set_num_threads(min(threads, len(cores)) if threads else len(cores))


def pin_threads(cores: tuple[int, ...]) -> None:
    """Pin every thread this process has now to cores (threads started later inherit the
    affinity of the thread that starts them). Torch's thread pool is left as it is."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:  # the thread has ended
            pass


def numa_resources(topo: Topology | None = None) -> dict[str, float]:
    """Ray custom resources that advertise this host's NUMA nodes: numa_node_<i>, its cores.
    `powerinfer serve` starts Ray with them (and the KubeRay manifest's workers declare them); a
    model's placement group asks for the nodes its core plan uses, so that Ray puts it on a
    host that has them."""
    topo = topo or Topology.read()
    return {f"numa_node_{i}": float(len(cores)) for i, cores in enumerate(topo.nodes)}


def node_of(cores: tuple[int, ...], topo: Topology | None = None) -> int:
    """The NUMA node holding most of `cores` (index into Topology.nodes)."""
    topo = topo or Topology.read()
    counts = [sum(c in n for c in cores) for n in topo.nodes]
    return max(range(len(counts)), key=counts.__getitem__)


def numa_pages(pid: int | str = "self") -> dict[int, int]:
    """Bytes of this process's private memory (heap and anonymous mappings) on each NUMA node,
    from /proc/PID/numa_maps: where first touch after pinning put them."""
    out: dict[int, int] = {}
    for line in Path(f"/proc/{pid}/numa_maps").read_text().splitlines():
        fields = line.split()
        if not ("anon=" in line or "heap" in fields):
            continue
        size = 4096
        for f in fields:
            if f.startswith("kernelpagesize_kB="):
                size = int(f.split("=")[1]) * 1024
        for f in fields:
            if f[0] == "N" and "=" in f and f[1:f.index("=")].isdigit():
                node, pages = f[1:].split("=")
                out[int(node)] = out.get(int(node), 0) + int(pages) * size
    return out
