"""One model's actor group: scheduler, predictor, hot executor and N cold executors in one
STRICT_PACK placement group, wired by the shared-memory channels the group owns.

Start: sweep segments left by dead owners, create this group's segments, place the actors
(each pinned to its core set), wait until every one has mapped its channels, unlink the
segments' names (from then on a crash anywhere leaves nothing in /dev/shm), then start each
actor's loop. `loops` are the loops' object refs: one that completes means the group is broken.
Stop: ask the scheduler to stop (its STOP cascades through the hot executor to the others),
then kill the actors and remove the placement group.
"""
from __future__ import annotations

import functools
import importlib.util
import logging
import os
import re
import time
from dataclasses import replace

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.topology import (CorePlan, Topology, node_of, parse_cpulist, plan_cores,
                              process_memory)
from powerinfer.config import DTYPES, ONE_EXECUTOR, Config
from powerinfer.errors import ConfigError, EngineFailedError
from powerinfer.formats.args import ModelArgs
from powerinfer.engine.plan import SparsePlan

from .channel import sweep
from .plane import SPIN_US, PlaneSpec, splits_attention
from .roles import ColdExecutor, HotExecutor, PredictorActor
from .scheduler import Scheduler

log = logging.getLogger("powerinfer")

# Ray's CPU accounting is nominal here: the group pins its actors to cores itself
CPU_SHARE = 0.01
START_TIMEOUT_S = 300


# the hot executor's cores where it has a GPU (see `ActorGroup.start`)
GPU_HOT_CORES = 2


def wants_gpu(config: Config) -> bool:
    """Whether the hot executor takes a GPU, decided against the cluster's GPUs (this process
    may see none: Ray hides GPUs from the processes it did not give one)."""
    gpus = ray.cluster_resources().get("GPU", 0)
    if config.device == "cuda" and gpus < 1:
        raise ConfigError("device='cuda' but the Ray cluster has no GPU; use device='cpu' or "
                          "'auto'")
    return config.device == "cuda" or (config.device == "auto" and gpus >= 1)


@functools.cache
def remote_class(cls):
    """`ray.remote(cls)`, made once a process: each call makes a new actor class, which Ray's
    worker keeps (its tracing wrappers, its export), so a model replica that made one at every
    group rebuild grew by about 5 MiB a rebuild."""
    return ray.remote(cls)


class ActorGroup:
    def __init__(self, args: ModelArgs, stored: dict, config: Config, plan: SparsePlan,
                 max_seq: int, num_blocks: int, spin_us: float = SPIN_US):
        # stored: the model's table ("model", a `ModelFile`) and its "tokenizer" as objects in
        # Ray's store, put there once per engine (`prepare.prepared`) and passed to the actors by
        # reference: an argument passed by value is serialized into the store again at every
        # actor's creation (a few MiB, twice a group), and the pages the owner wrote there count
        # in its memory (a replica grew by about 8 MiB at each group rebuild)
        self.args, self.stored = args, stored
        self.config, self.plan = config, plan
        self.max_seq, self.num_blocks, self.spin_us = max_seq, num_blocks, spin_us
        self.cores: CorePlan | None = None
        self.actors: dict[str, ray.actor.ActorHandle] = {}
        self.loops: list[ray.ObjectRef] = []
        self.pg = None
        self.spec: PlaneSpec | None = None
        self.info: dict = {}
        self.hot_share: float | None = None  # the hot executor's share of the work, once started

    @property
    def scheduler(self):
        try:
            return self.actors["scheduler"]
        except KeyError:  # stopped under the caller's feet: a rebuild is under way
            raise EngineFailedError("the model's actor group was stopped; send the request "
                                    "again") from None

    def start(self, wait_for_resources: bool = True) -> "ActorGroup":
        """Place and start the group's actors. wait_for_resources=False fails at once, with
        the resources named, when no live node offers what the group asks for (a rebuild
        after the model's node is gone: it retries, and requests are not kept waiting)."""
        sweep()
        gpu = wants_gpu(self.config)
        if self.config.cold_executors == 0 and (gpu or self.plan.bundle is not None):
            raise ConfigError(ONE_EXECUTOR)
        self.hot_share = self._plan_cores(gpu)
        self._create_plane()
        try:
            # on a CPU the executors share each layer's neurons by their cores' shares of the
            # work (`SparsePlan.dealt`): a solved placement (what a GPU's memory holds) places
            # nothing there, and its uneven layers kept one side waiting on the other
            if not gpu:
                self.plan = self.plan.dealt(self.hot_share)
            shared_gpu = self._shares_gpu(gpu)
            self._place_bundles(gpu, shared_gpu, wait_for_resources)
            self._start_actors(gpu, shared_gpu)
            self._handshake(shared_gpu)
        except BaseException:
            self.stop()
            raise
        finally:
            self.spec.unlink_all()  # every actor has mapped them, or the start failed
        self.loops = [a.run.remote() for a in self.actors.values()]
        return self

    def _plan_cores(self, gpu: bool) -> float:
        """The cores of each actor (`self.cores`) within the model's own, and the hot
        executor's share of the work where no placement decides it: its cores' share."""
        c, n = self.config, self.config.cold_executors
        topo = Topology.read()
        if c.cores:  # this model's own cores on a host shared with other models
            try:
                topo = topo.within(parse_cpulist(c.cores))
            except ValueError as e:
                raise ConfigError(f"cores={c.cores!r}: {e}") from None
        even = plan_cores(topo, n)
        distinct_cold = {x for g in even.cold for x in g} - set(even.hot)
        # on a GPU its cores launch kernels and wait on the device and the cold executors, with
        # the predictor and the scheduler beside it: a few cores, and every other one to the
        # cold executors, whose neurons bound the token
        self.cores = plan_cores(topo, n, min(GPU_HOT_CORES, len(even.hot))) if gpu else even
        return len(even.hot) / (len(even.hot) + len(distinct_cold)) if n else 1.0

    def _create_plane(self):
        """The shared-memory data plane (`PlaneSpec`): sized for a step of every running
        sequence and the probe, their decode rows and one prompt chunk (a whole prompt where
        prefill is not chunked), and the pool's blocks and the probe's."""
        c = self.config
        chunk = c.prefill_chunk or self.max_seq
        self.spec = PlaneSpec.new(c.cold_executors, c.max_batch + 1, c.max_batch + 1 + chunk,
                                  self.max_seq, self.num_blocks + 1, c.block_size, self.args,
                                  DTYPES[c.dtype], self.spin_us, c.cpu_isa)
        self.spec.create_all()

    def _shares_gpu(self, gpu: bool) -> bool:
        """Whether the predictor shares the hot executor's GPU (and bundle: one GPU, not any
        two of the node's), with CUDA IPC buffers between the two."""
        shared = gpu and self.plan.predictor_input is not None and \
            self.config.predictor_device == "auto"
        if shared and importlib.util.find_spec("cupy") is None:
            log.warning("the predictor runs on the CPU: sharing the GPU's buffers with the "
                        "hot executor needs CuPy (pip install 'powerinfer[gpu]')")
            shared = False
        if shared:
            self.spec = replace(self.spec, device_predictor=True)
        return shared

    def _place_bundles(self, gpu: bool, shared_gpu: bool, wait_for_resources: bool):
        """The placement group: a bundle per actor (hot, each cold executor, predictor,
        scheduler), each asking for the NUMA node its cores are on where the cluster advertises
        them (`cluster.topology.numa_resources`: Ray places the group on a host that has them)
        and for the resources the model asks for (a model pinned to some hosts)."""
        numa = any(k.startswith("numa_node_") for k in ray.cluster_resources())
        topo = Topology.read()  # node indices as numa_resources numbers them
        wanted = {k: CPU_SHARE for k, _ in self.config.resources}

        def bundle(cores, **extra):
            node = {f"numa_node_{node_of(cores, topo)}": CPU_SHARE} if numa else {}
            return {"CPU": CPU_SHARE, **node, **wanted, **extra}

        bundles = [bundle(self.cores.hot, **({"GPU": 1} if gpu else {}))]
        if shared_gpu:
            bundles[0]["CPU"] += CPU_SHARE
        bundles += [bundle(g) for g in self.cores.cold]
        bundles += [bundle(self.cores.predictor or self.cores.hot),  # predictor, scheduler
                    bundle(self.cores.hot)]
        self.pg = placement_group(bundles, strategy="STRICT_PACK")
        self._placed(self.pg, bundles, wait_for_resources)

    def _start_actors(self, gpu: bool, shared_gpu: bool):
        """The actors, each in its bundle: the hot executor, the cold executors, the predictor
        (with a bundle) and the scheduler."""
        c, n, spec, p = self.config, self.config.cold_executors, self.spec, self.plan

        def place(cls, i, concurrency=4, **kw):
            return remote_class(cls).options(
                num_cpus=CPU_SHARE, max_concurrency=concurrency, max_restarts=0, **kw,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, i))

        # on a CPU the executors split attention by heads as well, with a predictor where
        # its heads outweigh the neurons it picks (`plane.splits_attention`)
        attention = not gpu and splits_attention(self.args, p)
        self.actors["hot"] = place(HotExecutor, 0,
                                   num_gpus=(0.5 if shared_gpu else 1) if gpu else 0).remote(
            spec, self.cores.hot, self.stored["model"], c, p, self.hot_share,
            attention, runtime=os.environ.get("POWERINFER_HOT_EXECUTOR", "auto"))
        for k in range(n):
            self.actors[f"cold.{k}"] = place(ColdExecutor, 1 + k).remote(
                spec, k, self.cores.cold[k], self.stored["model"], p,
                self.hot_share, c.cpu_threads,
                c.cold_weights, head=not gpu, attention=attention)
        if p.predictor_input is not None:
            # on the GPU it mostly waits for the device: beside the hot executor, off the
            # cold executors' cores
            where = dict(i=0, num_gpus=0.5) if shared_gpu else dict(i=n + 1)
            cores = self.cores.hot if shared_gpu else self.cores.predictor
            self.actors["predictor"] = place(PredictorActor, **where).remote(
                spec, cores, p, c.cpu_threads)
        # every open stream is a call in flight: admission control is the scheduler's
        # queue, not Ray's
        self.actors["scheduler"] = place(Scheduler, n + 2, concurrency=10_000).remote(
            spec, self.args.vocab_size, self.stored["tokenizer"], c,
            self.cores.hot, self._spare(),
            sparse=p.bundle is not None)

    def _handshake(self, shared_gpu: bool):
        """Each actor's `ready` (what it holds, where: `self.info`), and the predictor's mapping
        of the hot executor's device buffers where they share a GPU."""
        names = list(self.actors)
        infos = ray.get([a.ready.remote() for a in self.actors.values()], timeout=START_TIMEOUT_S)
        self.info = dict(zip(names, infos))
        if shared_gpu:
            try:
                ray.get(self.actors["predictor"].attach.remote(self.info["hot"]["device_buffers"]),
                        timeout=START_TIMEOUT_S)
            except ray.exceptions.RayError as e:
                raise EngineFailedError(
                    "the predictor could not map the hot executor's GPU buffers (CUDA IPC "
                    f"between two processes on one GPU: {str(e).strip().splitlines()[-1][:300]}); "
                    "Config(predictor_device='cpu') keeps the predictor on host cores") from e

    def _spare(self) -> tuple[int, ...]:
        """The group's cores other than the hot executor's: the cold executors (and the
        predictor) wait on them between layers, yielding, while the hot core never idles."""
        hot = set(self.cores.hot)
        rest = {x for g in (*self.cores.cold, self.cores.predictor) for x in g} - hot
        return tuple(sorted(rest))

    def broken(self) -> str | None:
        """Why the group is broken (an actor's loop ended: it died or failed), or None."""
        loops, names = self.loops, list(self.actors)  # stop() may clear both meanwhile
        if not loops or len(loops) != len(names):
            return None
        done, _ = ray.wait(loops, timeout=0)
        if not done:
            return None
        name = names[loops.index(done[0])]
        try:
            return f"{name}: {ray.get(done[0])}"
        except Exception as e:  # noqa: BLE001 - its death is the answer
            return f"{name}: {type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}"

    def name_failure(self, why: str) -> str:
        """`why` led by the role of the actor it names by pid, where it names one only so (the
        native loops see a peer's process gone before Ray reports the actor dead)."""
        for pid in re.findall(r"\bpid (\d+)", why):
            for name, info in self.info.items():
                if str(info.get("pid")) == pid and not why.startswith(f"{name}:"):
                    return f"{name}: {why}"
        return why

    def stop(self):
        if "scheduler" in self.actors and self.loops and not self.broken():
            try:
                ray.get(self.scheduler.stop.remote(), timeout=5)
            except Exception:  # noqa: BLE001 - it is being killed anyway
                pass
        for a in self.actors.values():
            ray.kill(a, no_restart=True)
        self.actors, self.loops = {}, []
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None
        if self.spec is not None:
            self.spec.unlink_all()

    @staticmethod
    def _placed(pg, bundles: list[dict], wait_for_resources: bool):
        ready, deadline = pg.ready(), time.monotonic() + START_TIMEOUT_S
        while not ray.wait([ready], timeout=1.0)[0]:
            if not wait_for_resources:
                have = ray.cluster_resources()
                absent = sorted({k for b in bundles for k in b if have.get(k, 0) <= 0})
                if absent:
                    raise EngineFailedError(f"no live node of the cluster offers {absent}, "
                                            "which the model's actor group asks for")
            if time.monotonic() > deadline:
                raise EngineFailedError(f"the model's actor group could not be placed within "
                                        f"{START_TIMEOUT_S} s (resources asked per actor: "
                                        f"{bundles[0]})")
        ray.get(ready)

    def stats(self, timeout: float = 10.0) -> dict:
        names = list(self.actors)
        refs = [self.actors[k].stats.remote() for k in names]
        out = {}
        for k, r in zip(names, refs):
            try:
                out[k] = ray.get(r, timeout=timeout)
            except Exception as e:  # noqa: BLE001 - a dead actor's stats are its error
                out[k] = {"error": f"{type(e).__name__}: {e}"}
        return out


class _Bare:
    """An actor that imports and initializes what an executor does and holds no model."""

    def __init__(self):
        import torch

        from powerinfer import kernels

        from . import cold_executor, hot_executor, predictor, scheduler  # noqa: F401
        kernels.available()
        torch.ones(64, 64) @ torch.ones(64, 64)  # the intra-op thread pool

    def memory(self) -> dict:
        return process_memory()


def process_overhead(timeout: float = 120.0) -> dict[str, int]:
    """The memory of a bare actor process (`process_memory`'s keys): the fixed cost of each
    process of a group (Python, torch, Ray's worker), beside what it holds of the model."""
    actor = ray.remote(_Bare).options(num_cpus=CPU_SHARE).remote()
    try:
        return ray.get(actor.memory.remote(), timeout=timeout)
    finally:
        ray.kill(actor)
