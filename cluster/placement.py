"""Several models planned onto one host: for each model's actor group, the NUMA nodes it uses,
disjoint core sets for its hot executor, predictor, scheduler and each cold executor, its GPU
and VRAM share, and the memory each node must hold; or a refusal that names what is short.

A host is read from sysfs (`Host.read`: NUMA nodes with their cores and memory, GPUs with their
memory and nearest node) or from a YAML description of a box that is not this one
(`Host.from_yaml`). A model is a file (its tensors' sizes are read from its header) or a shape
(`params:`, for a model that is not here), with what its group wants: cold executors, cores per
cold executor, a VRAM budget, concurrency (sequences the KV cache holds at once) and context.

Memory per process follows what `benchmarks/memory.py` measured (BENCHMARKS.md, "Memory"):
weights held in the kernel's formats (gate/up in the file's blocks, down in Q8_0 beside 4-bit
blocks), the KV cache in the hot executor's memory (on the GPU when there is one), and a fixed
cost of `PROCESS_GB` for each process.

The plan is greedy and deterministic: models with a GPU first, largest first; a model's home
node is its GPU's nearest node (else the node with the most free cores); its hot executor,
scheduler and predictor take cores there, and each cold executor takes whole cores on one node,
the home node first, then the nearest others, so that its memory is local to its cores.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from .topology import SYS_NODE, Topology, parse_cpulist

GB = 1e9
PROCESS_GB = 0.35  # fixed cost of one process of a group: Python, torch, Ray's worker (measured)
CUDA_CONTEXT_GB = 1.0  # the CUDA context and workspace on a GPU


class PlanError(ValueError):
    """A plan that does not fit: the message names the model, what is short and by how much."""


def _read_yaml(path: str | Path):
    """A host's or a models file's contents; PlanError where it is not YAML."""
    import yaml

    try:
        return yaml.safe_load(Path(path).read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise PlanError(f"{path}: not a YAML file ({e})") from None


@dataclass(frozen=True)
class Node:
    id: int
    cores: tuple[int, ...]
    memory_gb: float


@dataclass(frozen=True)
class GPU:
    id: int
    memory_gb: float
    numa_node: int


@dataclass(frozen=True)
class Host:
    name: str
    nodes: tuple[Node, ...]
    gpus: tuple[GPU, ...] = ()

    @classmethod
    def read(cls, sys_node: Path = SYS_NODE) -> "Host":
        """This machine: its NUMA nodes (usable cores, MemTotal) and the GPUs torch sees."""
        topo = Topology.read(sys_node)
        nodes = []
        for i, cores in enumerate(topo.nodes):
            meminfo = sys_node / f"node{i}" / "meminfo"
            kb = 0
            if meminfo.is_file():
                for line in meminfo.read_text().splitlines():
                    if "MemTotal:" in line:
                        kb = int(line.split()[-2])
            if not kb:
                kb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 1024 // len(topo.nodes)
            nodes.append(Node(i, cores, kb * 1024 / GB))
        return cls(os.uname().nodename, tuple(nodes), _gpus())

    @classmethod
    def from_yaml(cls, path: str | Path) -> "Host":
        d = _read_yaml(path)
        try:
            nodes = tuple(Node(int(n["id"]), tuple(parse_cpulist(str(n["cores"]))),
                               float(n["memory_gb"])) for n in d["numa_nodes"])
            gpus = tuple(GPU(int(g["id"]), float(g["memory_gb"]), int(g["numa_node"]))
                         for g in d.get("gpus") or ())
        except (KeyError, TypeError, ValueError) as e:
            raise PlanError(f"{path}: a host needs numa_nodes (id, cores, memory_gb) and may "
                            f"list gpus (id, memory_gb, numa_node): {type(e).__name__}: {e}") from None
        ids = {n.id for n in nodes}
        if len(ids) < len(nodes) or any(n.memory_gb <= 0 for n in nodes):
            raise PlanError(f"{path}: each NUMA node needs its own id and memory_gb over 0")
        cores = [c for n in nodes for c in n.cores]
        if len(set(cores)) < len(cores):  # (two nodes of one set were counted twice)
            raise PlanError(f"{path}: a core is listed in two NUMA nodes")
        bad = [g.id for g in gpus if g.numa_node not in ids]
        if bad:
            raise PlanError(f"{path}: gpu {bad[0]} names a NUMA node the host does not list")
        return cls(str(d.get("name", Path(path).stem)), nodes, gpus)

    @property
    def cores(self) -> int:
        return sum(len(n.cores) for n in self.nodes)


def _gpus() -> tuple[GPU, ...]:
    try:
        import torch
        if not torch.cuda.is_available():
            return ()
        out = []
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            bus = p.pci_bus_id.lower() if hasattr(p, "pci_bus_id") else ""
            node_file = Path(f"/sys/bus/pci/devices/{bus}/numa_node")
            node = int(node_file.read_text()) if bus and node_file.is_file() else 0
            out.append(GPU(i, p.total_memory / GB, max(node, 0)))
        return tuple(out)
    except Exception:  # noqa: BLE001 - no usable CUDA here: a CPU-only host
        return ()


@dataclass(frozen=True)
class ModelSpec:
    """What one model's group needs. Sizes in GB: attention (+ norms), ffn (in the kernel's
    formats), embeddings (embedding + head), kv per token."""
    name: str
    attention_gb: float
    ffn_gb: float
    embeddings_gb: float
    kv_gb_per_token: float
    cold_executors: int = 2
    cores_per_cold: int = 2
    hot_cores: int = 2
    vram_budget_gb: float = 0.0
    concurrency: int = 4
    context: int = 2048
    predictor: bool = True

    @property
    def weights_gb(self) -> float:
        return self.attention_gb + self.ffn_gb + self.embeddings_gb

    @property
    def kv_gb(self) -> float:
        return self.kv_gb_per_token * (self.concurrency + 1) * self.context


def _sizes_from_shape(p: dict) -> tuple[float, float, float, float]:
    """GB of attention, FFN, embeddings and KV per token of a LLaMA shape in a Q4_0 file, held
    as the runtime holds it (gate/up 4.5 bits, down Q8_0 8.5 bits, attention int4 5 bits,
    embeddings 4.5 and the head 8.5 bits; KV in bf16)."""
    dim, ff, layers = int(p["dim"]), int(p["n_ff"]), int(p["layers"])
    heads, kv_heads, vocab = int(p["heads"]), int(p.get("kv_heads", p["heads"])), int(p["vocab"])
    if min(dim, ff, layers, heads, kv_heads, vocab) < 1:  # (a zero was a ZeroDivisionError)
        raise PlanError(f"params: dim, n_ff, layers, heads, kv_heads and vocab must be >= 1, "
                        f"got {p}")
    head_dim = dim // heads
    attn = layers * (2 * dim * dim + 2 * dim * kv_heads * head_dim) * 5 / 8
    ffn = layers * dim * ff * (2 * 4.5 + 8.5) / 8
    emb = vocab * dim * (4.5 + 8.5) / 8
    kv = layers * 2 * kv_heads * head_dim * 2
    return attn / GB, ffn / GB, emb / GB, kv / GB


def _sizes_from_file(model: str) -> tuple[float, float, float, float]:
    """The same sizes read from a model file's header (its tensor table)."""
    import numpy as np

    from powerinfer.kernels import down_format, row_bytes
    from powerinfer.formats.loader import load_checkpoint
    from powerinfer.sparsity.solver import gpu_bytes

    ck = load_checkpoint(model, with_weights=False)
    src, a = ck.source, ck.args
    stored = getattr(src, "table", None)

    def nbytes(name: str) -> float:
        if name not in src.names:
            return 0.0
        if stored is not None:
            return stored[name].nbytes
        return float(np.prod(src.shape(name))) * 2  # safetensors: bf16

    attn = ffn = 0.0
    for i in range(a.n_layers):
        attn += sum(nbytes(f"{i}.{r}") for r in ("q", "k", "v", "o", "attn_norm", "ffn_norm"))
        gate_up = nbytes(f"{i}.gate") + nbytes(f"{i}.up")
        kind = src.kind(f"{i}.up").lower()
        fmt = kind if kind in ("q4_0", "q4_1") else None
        down = (a.ffn_dim * row_bytes(down_format(fmt), a.dim) if fmt
                else nbytes(f"{i}.down") or nbytes(f"{i}.down_t"))
        ffn += gate_up + down
    emb = nbytes("embed") + nbytes("output")
    kv = gpu_bytes(a, dtype_bytes=2, batch=1, context=1)["kv_cache"]  # bf16, one position
    return attn / GB, ffn / GB, emb / GB, kv / GB


def models_from_yaml(path: str | Path) -> list[ModelSpec]:
    d = _read_yaml(path)
    if not isinstance(d, dict):
        raise PlanError(f"{path}: expected a mapping with a `models` list")
    out = []
    keys = ("cold_executors", "cores_per_cold", "hot_cores", "vram_budget_gb", "concurrency",
            "context", "predictor")
    for m in d.get("models") or ():
        if not isinstance(m, dict):
            raise PlanError(f"{path}: each model is a mapping, got {m!r:.60}")
        unknown = set(m) - {"name", "model", "params", *keys}
        if unknown:  # (ignored before: a misspelt key planned with its default)
            raise PlanError(f"{path}: model {m.get('name')!r}: unknown keys {sorted(unknown)}")
        if any(str(m.get("name")) == o.name for o in out):  # (both were planned on one core set)
            raise PlanError(f"{path}: model {m.get('name')!r} is listed twice")
        try:
            name = str(m["name"])
            sizes = (_sizes_from_shape(m["params"]) if "params" in m
                     else _sizes_from_file(str(m["model"])))
        except KeyError as e:
            raise PlanError(f"{path}: each model needs a name and either `model` (a file) or "
                            f"`params` (dim, n_ff, layers, heads, kv_heads, vocab); missing {e}") from None
        out.append(ModelSpec(name, *sizes, **{k: m[k] for k in keys if k in m}))
    if not out:
        raise PlanError(f"{path}: no models listed")
    return out


@dataclass
class GroupPlan:
    model: str
    home: int
    hot: tuple[int, ...]
    scheduler: tuple[int, ...]
    predictor: tuple[int, ...]
    cold: list[tuple[int, tuple[int, ...]]]  # (node, cores) per cold executor
    gpu: int | None
    vram_gb: float
    memory_gb: dict[int, float] = field(default_factory=dict)  # per NUMA node

    @property
    def nodes(self) -> list[int]:
        return sorted(self.memory_gb)

    def cores(self) -> list[int]:
        return [*self.hot, *self.scheduler, *self.predictor, *(c for _, g in self.cold for c in g)]


@dataclass
class Plan:
    host: Host
    groups: list[GroupPlan]

    def table(self) -> str:
        rows = ["| model | NUMA nodes | hot | scheduler | predictor | cold executors (node: cores) "
                "| GPU (VRAM GB) | memory GB per node |", "|---|---|---|---|---|---|---|---|"]
        for g in self.groups:
            cold = "; ".join(f"{n}: {_cpus(c)}" for n, c in g.cold)
            gpu = "-" if g.gpu is None else f"{g.gpu} ({g.vram_gb:.1f})"
            mem = ", ".join(f"{n}: {v:.1f}" for n, v in sorted(g.memory_gb.items()))
            rows.append(f"| {g.model} | {', '.join(map(str, g.nodes))} | {_cpus(g.hot)} | "
                        f"{_cpus(g.scheduler)} | {_cpus(g.predictor) or '-'} | {cold} | {gpu} | {mem} |")
        used = {n.id: sum(g.memory_gb.get(n.id, 0) for g in self.groups) for n in self.host.nodes}
        busy = sum(len(g.cores()) for g in self.groups)
        rows.append("")
        rows.append(f"{self.host.name}: {busy} of {self.host.cores} cores planned; memory per node "
                    + ", ".join(f"{n.id}: {used[n.id]:.1f}/{n.memory_gb:.0f} GB" for n in self.host.nodes))
        return "\n".join(rows)


def _cpus(cores) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    cores, out, i = sorted(cores), [], 0
    while i < len(cores):
        j = i
        while j + 1 < len(cores) and cores[j + 1] == cores[j] + 1:
            j += 1
        out.append(str(cores[i]) if i == j else f"{cores[i]}-{cores[j]}")
        i = j + 1
    return ",".join(out)


def plan(host: Host, models: list[ModelSpec]) -> Plan:
    free = {n.id: list(n.cores) for n in host.nodes}
    mem = {n.id: n.memory_gb for n in host.nodes}
    vram = {g.id: g.memory_gb - CUDA_CONTEXT_GB for g in host.gpus}
    order = sorted(models, key=lambda m: (m.vram_budget_gb <= 0, -m.weights_gb))
    groups = []
    for m in order:
        groups.append(_place(host, m, free, mem, vram))
    by_name = {g.model: g for g in groups}
    return Plan(host, [by_name[m.name] for m in models])


def _take(free: dict, node: int, k: int) -> tuple[int, ...]:
    got, free[node] = tuple(free[node][:k]), free[node][k:]
    return got


def _place(host: Host, m: ModelSpec, free: dict, mem: dict, vram: dict) -> GroupPlan:
    gpu, vram_gb = None, 0.0
    if m.vram_budget_gb > 0:
        if not host.gpus:
            raise PlanError(f"model {m.name}: wants {m.vram_budget_gb:.1f} GB of VRAM; "
                            f"{host.name} has no GPU")
        best = max(host.gpus, key=lambda g: vram[g.id])
        if vram[best.id] < m.vram_budget_gb:
            raise PlanError(f"model {m.name}: wants {m.vram_budget_gb:.1f} GB of VRAM; the GPU with "
                            f"the most left (gpu {best.id}) has {vram[best.id]:.1f} GB: "
                            f"{m.vram_budget_gb - vram[best.id]:.1f} GB short")
        gpu, vram_gb = best.id, m.vram_budget_gb
        vram[gpu] -= vram_gb
        home = best.numa_node
    else:
        home = max(host.nodes, key=lambda n: (len(free[n.id]), mem[n.id])).id
    near = sorted((n.id for n in host.nodes), key=lambda i: (abs(i - home), i))

    # what lives where: the hot executor's host part (all of it without a GPU), and the cold
    # executors' share of the FFN the GPU does not hold
    on_gpu = 0.0
    if gpu is not None:  # attention, KV and the hottest FFN rows, as far as the budget goes
        on_gpu = min(m.ffn_gb, max(0.0, vram_gb - m.attention_gb - m.kv_gb))
    hot_host = PROCESS_GB + m.embeddings_gb + (0 if gpu is not None else m.attention_gb + m.kv_gb)
    cold_each = (m.ffn_gb - on_gpu) / max(1, m.cold_executors) + PROCESS_GB
    if gpu is None:  # the hot executor computes its share of the FFN on its own cores
        share = m.hot_cores / max(1, m.hot_cores + m.cold_executors * m.cores_per_cold)
        hot_host += m.ffn_gb * share
        cold_each = m.ffn_gb * (1 - share) / max(1, m.cold_executors) + PROCESS_GB

    g = GroupPlan(m.name, home, (), (), (), [], gpu, vram_gb)
    need_home = m.hot_cores + 1 + int(m.predictor)
    home_need_gb = hot_host + 2 * PROCESS_GB if m.predictor else hot_host + PROCESS_GB
    if len(free[home]) < need_home or mem[home] < home_need_gb:
        raise PlanError(f"model {m.name}: its hot executor, scheduler and predictor need "
                        f"{_cores(need_home)} and {home_need_gb:.1f} GB on NUMA node {home}"
                        + (f" (nearest to gpu {gpu})" if gpu is not None else "")
                        + f"; it has {_cores(len(free[home]))} and {mem[home]:.1f} GB left: "
                        + _short(need_home - len(free[home]), home_need_gb - mem[home]))
    g.hot, g.scheduler = _take(free, home, m.hot_cores), _take(free, home, 1)
    g.predictor = _take(free, home, 1) if m.predictor else ()
    mem[home] -= home_need_gb
    g.memory_gb[home] = home_need_gb
    for k in range(m.cold_executors):
        node = next((n for n in near if len(free[n]) >= m.cores_per_cold and mem[n] >= cold_each),
                    None)
        if node is None:
            most = max(near, key=lambda n: (len(free[n]), mem[n]))
            raise PlanError(f"model {m.name}: cold executor {k} needs {_cores(m.cores_per_cold)} "
                            f"and {cold_each:.1f} GB on one NUMA node; the best left (node {most}) "
                            f"has {_cores(len(free[most]))} and {mem[most]:.1f} GB: "
                            + _short(m.cores_per_cold - len(free[most]), cold_each - mem[most])
                            + f" (give it fewer cold_executors; 0: one executor with the whole "
                              "model)")
        g.cold.append((node, _take(free, node, m.cores_per_cold)))
        mem[node] -= cold_each
        g.memory_gb[node] = g.memory_gb.get(node, 0.0) + cold_each
    return g


def _cores(n: int) -> str:
    return f"{n} core{'s' * (n != 1)}"


def _short(cores: int, gb: float) -> str:
    parts = [f"{_cores(cores)} short" if cores > 0 else "", f"{gb:.1f} GB short" if gb > 0 else ""]
    return " and ".join(p for p in parts if p)


def add_command(sub):
    """`powerinfer plan`: print the plan of several models on a host as a table."""
    p = sub.add_parser("plan", help="plan several models' actor groups onto one host's NUMA "
                                    "nodes, cores, memory and GPUs")
    p.add_argument("--host", default=None, metavar="HOST.yaml",
                   help="a description of the host (default: this machine, from sysfs)")
    p.add_argument("--models", required=True, metavar="MODELS.yaml",
                   help="the models to host (see cluster/hosts/models-example.yaml)")
    p.add_argument("--serve-config", default=None, metavar="OUT.yaml",
                   help="also write a models file for `powerinfer serve --config` that runs "
                        "each planned model (those given as files) on its planned cores")
    p.set_defaults(run=_run)


def serve_config(p: Plan, models_yaml: str | Path) -> dict:
    """`powerinfer serve`'s models file for a plan: each model given as a file, with its
    group's cores (`cores`), cold executors, batch (its concurrency), context and GPU share."""
    import yaml

    entries = {m["name"]: m for m in yaml.safe_load(Path(models_yaml).read_text())["models"]}
    out = []
    for g in p.groups:
        m = entries[g.model]
        if "model" not in m:
            continue  # a shape on paper: nothing to load
        out.append({"name": g.model, "model": str(m["model"]), "cores": _cpus(g.cores()),
                     "cold_executors": len(g.cold), "max_batch": int(m.get("concurrency", 4)),
                     "max_seq_len": int(m.get("context", 2048)),
                     **({"device": "cuda", "vram_budget_gb": g.vram_gb}
                        if g.gpu is not None else {})})
    return {"models": out}


def _run(args) -> int:
    import sys

    try:
        host = Host.from_yaml(args.host) if args.host else Host.read()
        p = plan(host, models_from_yaml(args.models))
        print(p.table())
        if args.serve_config:
            import yaml
            Path(args.serve_config).write_text(yaml.safe_dump(serve_config(p, args.models),
                                                              sort_keys=False))
            print(f"wrote {args.serve_config}: powerinfer serve --config {args.serve_config}")
    except (PlanError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
