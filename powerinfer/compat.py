"""Workarounds for library versions and platforms, kept in one place."""
from __future__ import annotations

import contextlib
import functools
import os
import struct
import types
from collections.abc import Sequence
from pathlib import Path

import numpy as np

_PWRI_INT_TYPES = {16: 24, 17: 25, 18: 26}  # I8, I16, I32: the original's ggml -> today's


def gguf_reader(path):
    """A `gguf.GGUFReader` that parses over a plain ndarray view of its memory map, and also reads
    the original PowerInfer's files (see pwri.py).

    The stock reader slices an `np.memmap` hundreds of thousands of times while reading metadata,
    and memmap's `__array_finalize__` dominates (over 3 s for a 49k-token vocabulary); the same
    parse over a plain view of the same mapping takes a fraction of that.

    PowerInfer's files start with b"PWRI" (kept in `magic`), which the stock reader refuses, and
    were written for a ggml whose types ended with I8, I16, I32 = 16, 17, 18; today's ggml gives
    those numbers to IQ2_XXS, IQ2_XS, IQ3_XXS and numbers the integer types 24, 25, 26.
    """
    return reader_class()(path, "r")


@functools.cache
def reader_class():
    """The reader class `gguf_reader` makes (a subclass of `gguf.GGUFReader`), made once."""
    import gguf

    class _PlainViewReader(gguf.GGUFReader):
        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, value):
            self._plain = value.view(np.ndarray)

        @property
        def magic(self) -> bytes:
            return self._plain[:4].tobytes()

        def _get(self, offset, dtype, count=1, override_order=None):
            got = super()._get(offset, dtype, count, override_order)
            if offset == 0 and self.magic == b"PWRI":  # the magic check: same layout as GGUF v3
                return np.array([gguf.GGUF_MAGIC], dtype=got.dtype)
            return got

        def _get_tensor_info_field(self, offs):
            field = super()._get_tensor_info_field(offs)  # parts[4]: the ggml type
            if self.magic == b"PWRI" and int(field.parts[4][0]) in _PWRI_INT_TYPES:
                field.parts[4] = np.array([_PWRI_INT_TYPES[int(field.parts[4][0])]], np.uint32)
            return field

        def _get_field_parts(self, orig_offs, raw_type):
            fast = raw_type == gguf.GGUFValueType.ARRAY and self.byte_order == "I"
            got = _array_field_parts(self, orig_offs) if fast else None
            # (inside another array, the stock walk adds an ArrayParts' parts to its list)
            return super()._get_field_parts(orig_offs, raw_type) if got is None else got

        def _build_fields(self, offs, count):
            """The stock walk over the key-value pairs, but an array of strings or numbers
            keeps its parts as an `ArrayParts` (made when asked for) rather than a list."""
            if self.byte_order != "I":
                return super()._build_fields(offs, count)
            for _ in range(count):
                orig_offs = offs
                kv_klen, kv_kdata = self._get_str(offs)
                offs += int(kv_klen.nbytes + kv_kdata.nbytes)
                raw_kv_type = self._get(offs, np.uint32)
                offs += int(raw_kv_type.nbytes)
                head = [kv_klen, kv_kdata, raw_kv_type]
                size, parts, idxs, types = self._get_field_parts(offs, raw_kv_type[0])
                if isinstance(parts, ArrayParts):
                    parts.head = head + parts.head
                else:
                    parts = head + parts
                self._push_field(gguf.ReaderField(
                    orig_offs, str(bytes(kv_kdata), encoding="utf-8"), parts,
                    [i + len(head) for i in idxs], types), skip_sum=True)
                offs += size
            return offs

    return _PlainViewReader


class ArrayParts(Sequence):
    """A GGUF array field's parts as `GGUFReader` lists them (its head: the key's and the
    element type's and count's views; then each element's: a string's length and bytes, a
    number's one-element view), each view made when it is asked for: a 262k-token vocabulary
    is about a million of them, which took a second a parse to make. `contents()` decodes the
    whole array at once."""

    def __init__(self, head, data, starts=None, lengths=None, values=None):
        self.head, self._data = head, data
        self._starts, self._lengths, self._values = starts, lengths, values
        self._each = 1 if values is not None else 2

    def __len__(self):
        n = len(self._values) if self._values is not None else len(self._starts)
        return len(self.head) + self._each * n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        if i < len(self.head):
            return self.head[i]
        k = i - len(self.head)
        if self._values is not None:
            return self._values[k:k + 1]
        o = self._starts[k // 2]
        if k % 2 == 0:
            return self._data[o:o + 8].view(np.uint64)
        return self._data[o + 8:o + 8 + self._lengths[k // 2]]

    def contents(self) -> list:
        """The elements, decoded (as `ReaderField.contents()` gives them)."""
        if self._values is not None:
            return self._values.tolist()
        first = self._starts[0]
        raw = self._data[first:self._starts[-1] + 8 + self._lengths[-1]].tobytes()
        return [str(raw[o - first + 8:o - first + 8 + n], encoding="utf-8")
                for o, n in zip(self._starts, self._lengths)]


def _array_field_parts(reader, orig_offs: int):
    """`GGUFReader._get_field_parts` for an array of strings or numbers: the same parts (per
    element, views of the same bytes) as an `ArrayParts`, found by one walk over the lengths
    instead of a `_get` call per element: a 262k-token vocabulary took 3 s a parse that way,
    paid by every load of the file. None for an array of arrays (the stock walk reads those)."""
    import gguf

    T = gguf.GGUFValueType
    data = reader.data
    raw_itype = data[orig_offs:orig_offs + 4].view(np.uint32)
    alen = data[orig_offs + 4:orig_offs + 12].view(np.uint64)
    offs, itype, n = orig_offs + 12, int(raw_itype[0]), int(alen[0])
    head = [raw_itype, alen]
    if n == 0:  # as the stock walk: no element, so no element type
        return 12, head, [], [T.ARRAY]
    if itype == T.STRING:
        starts, lengths = [], []
        o, end, unpack, buf = offs, len(data), struct.Struct("=Q").unpack_from, memoryview(data)
        for _ in range(n):
            (length,) = unpack(buf, o)  # (byte_order "I": this host's)
            starts.append(o)
            lengths.append(length)
            o += 8 + length
        if o > end:
            raise ValueError(f"a string at offset {starts[-1]} runs past the end of the file")
        return o - orig_offs, ArrayParts(head, data, starts, lengths), \
            list(range(3, 3 + 2 * n, 2)), [T.ARRAY, T.STRING]
    nptype = reader.gguf_scalar_to_np.get(T(itype))
    if nptype is None:
        return None
    size = n * np.dtype(nptype).itemsize
    if offs + size > len(data):
        raise ValueError(f"an array at offset {orig_offs} runs past the end of the file")
    values = data[offs:offs + size].view(nptype)
    return 12 + size, ArrayParts(head, data, values=values), list(range(2, 2 + n)), \
        [T.ARRAY, T(itype)]


def vector_bits() -> int:
    """The vector width Inductor's C++ code is generated for in this process (512, 256; 1: none),
    named in the compiled step's options so that its cache keys on it. Left implicit, Inductor
    takes it from the CPU or ATEN_CPU_CAPABILITY, which its cache does not key on: code cached
    for 512-bit vectors, built again for 256-bit ones (`ATEN_CPU_CAPABILITY=avx2` on an AVX-512
    host, or a cache moved to an AVX2 host), stepped 16 floats a vector of 8 and decoded
    garbage."""
    from torch._inductor import cpu_vec_isa
    return cpu_vec_isa.pick_vec_isa().bit_width() or 1


def compile_per_instance(method, cpp_wrapper: bool = False):
    """torch.compile a bound method with its own compiled-code cache, and without re-checking
    the module state on every call. cpp_wrapper: Inductor calls the compiled kernels from
    generated C++ rather than Python (on a CPU, where a small model's decode step is mostly the
    cost of calling its ops: SmolLM2 161-188 -> 198-238 tok/s measured; the first compile
    takes longer, 92 s against 50, later ones come from Inductor's cache).

    Dynamo's guards on every parameter and submodule cost over 1 ms a decode step of a 30-layer
    model; the documented filter that skips them assumes one model per compiled function, but
    Dynamo keeps one cache per code object, which every instance of a class shares: a second
    model would be handed the first model's graph. A copy of the code object gives this instance
    a cache of its own."""
    fn = method.__func__
    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__,
                             fn.__defaults__, fn.__closure__)
    import torch

    compiled = torch.compile(types.MethodType(own, method.__self__), dynamic=True, options={
        "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
        "cpp_wrapper": cpp_wrapper, "cpp.simdlen": vector_bits()})
    cfg = torch.fx.experimental._config

    def step(*args, **kwargs):
        # No "duck sizing" while this traces (Dynamo guards that two sizes seen equal once stay
        # equal: a batch of two over block tables two wide would compile again when the tables
        # widen), for this function only; 4 us a call
        prev, cfg.use_duck_shape = cfg.use_duck_shape, False
        try:
            return compiled(*args, **kwargs)
        finally:
            cfg.use_duck_shape = prev
    return step


# a local instance's GCS keeps the events of this many tasks (Ray's default: 100,000) for its
# state API (`ray list tasks`), about 3 KiB each: a server's every request is a few actor tasks
# and Serve's control loop adds its own, so a server under load grew by tens of MB an hour
# (`benchmarks/gcs_memory.py`); nothing of this project reads them
LOCAL_RAY_CONFIG = {"task_events_max_num_task_in_gcs": 1_000}


def private_ray_token(create: bool = True) -> Path | None:
    """Ray's token file (RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token) readable by this user
    only: made so where it is missing (`create`: a new cluster's; a node that joins one uses
    the head's token), and its mode narrowed where another user could read it
    (Ray writes it with the process's umask, commonly readable by every user of the machine,
    any of whom could then run code in this user's cluster). None where the token comes from
    RAY_AUTH_TOKEN."""
    import secrets
    import stat

    if os.environ.get("RAY_AUTH_TOKEN"):
        return None
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    if not path.exists():
        if not create:
            return None
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:  # (256 bits, as Ray makes its own)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
        except FileExistsError:  # (another process made it meanwhile)
            pass
    if path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        path.chmod(0o600)
    return path


def ray_init(runtime_env: dict | None = None, resources: dict | None = None):
    """Connect to the Ray cluster in RAY_ADDRESS, or start a local one for this process.

    A local instance is started with token authentication on (RAY_AUTH_MODE=token): without a
    token anyone who reaches a Ray port can run code in the cluster. The token is kept in
    ~/.ray/auth_token, readable by this user only (`private_ray_token`). A local instance is also this machine's alone:
    its node address is the loopback one (`loopback_node`), so none of its ports listens on the
    network, not even the Prometheus exporters that Ray serves without the token. A cluster this
    process joins keeps its own settings. Without RAY_ADDRESS it is a new instance even where a
    `ray start` cluster is recorded on the machine (/tmp/ray/ray_current_cluster), which
    `ray.init()` with no address would join: perhaps one started without authentication, or
    another user's."""
    import ray
    if ray.is_initialized():
        return
    local = not os.environ.get("RAY_ADDRESS")
    if local:
        private_ray_token()
        os.environ["RAY_AUTH_MODE"] = "token"
        # Ray reads its settings once, at import; reload them as Ray's own default-on path does
        # (ray._private.authentication.authentication_token_setup._enable_token_auth)
        from ray._raylet import Config
        Config.initialize("")
    kw = {}
    if local:
        kw["address"] = "local"  # this process's own instance, not a cluster found on the machine
        if resources:  # custom resources of a local instance
            kw["resources"] = resources
        kw["_system_config"] = dict(LOCAL_RAY_CONFIG)  # (a copy: Ray adds its own keys to it)
    for attempt in (1, 2):
        before = _descendants()
        try:
            with loopback_node(local):
                ray.init(include_dashboard=False, logging_level="warning", log_to_driver=True,
                         runtime_env=runtime_env, **kw)
            return
        except (KeyboardInterrupt, SystemExit):
            # stopped while the instance starts (Ctrl-C, or a SIGTERM: ray.init sets a handler
            # that exits): what this attempt started goes too (Ray left its dashboard and
            # runtime-env agents running for minutes, and they held their ports)
            if local:
                with contextlib.suppress(Exception):
                    ray.shutdown()
                _kill([p for pid, p in _descendants().items()
                       if pid not in before and _ray_process(p)])
            raise
        except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception for this one
            # a local raylet that took over Ray's fixed 30 s to register (a loaded machine, or
            # the last instance's processes still exiting): stop what this attempt started
            # (Ray leaves a half-started node's processes running) and start afresh, once
            if attempt == 2 or not local or \
                    "timed out during startup" not in str(e):
                raise
            import logging
            logging.getLogger("powerinfer").warning("a local Ray instance did not come up in "
                                                    "time (%s); starting it again", e)
            ray.shutdown()
            _kill([p for pid, p in _descendants().items() if pid not in before and _ray_process(p)])


# Ray's switch for a node that only this machine reaches (its default where Ray supports no
# cluster, macOS and Windows): the node's address is then 127.0.0.1 where it would be the
# machine's outward one; its GCS, raylet, workers, agents and metrics exporters bind it
LOOPBACK_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextlib.contextmanager
def loopback_node(local: bool = True):
    """While a local instance starts (or a process joins one at its 127.0.0.1 address), give it
    the loopback address. `ray.init(_node_ip_address="127.0.0.1")` does not: Ray turns a
    loopback address into the outward one, and then its autoscaler's and dashboard's Prometheus
    exporters (ports 44217 and 44227) and the dashboard agent's listen on every interface and
    answer without the token, and the GCS and raylet bind every interface too; a process that
    joins would look for the GCS at the outward address. Ray reads the switch at import and
    again from the environment in the processes it starts, so both are set, and put back after
    the start (a later connection to a cluster in this process finds its own address)."""
    if not local:
        yield
        return
    from ray._private import ray_constants

    env, const = os.environ.get(LOOPBACK_SWITCH), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[LOOPBACK_SWITCH] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = const
        if env is None:
            os.environ.pop(LOOPBACK_SWITCH, None)
        else:
            os.environ[LOOPBACK_SWITCH] = env


def _descendants() -> dict:
    import psutil

    return {p.pid: p for p in psutil.Process().children(recursive=True)}


# what a local Ray node runs: its GCS and raylet binaries, its Python services (log monitor,
# dashboard agents, the reaper) and its workers ("ray::...")
_RAY_PROCESSES = ("gcs_server", "raylet", "ray/_private/", "ray/dashboard/", "ray/autoscaler/",
                  "ray::", "ray_process_reaper")


def _ray_process(p) -> bool:
    """Whether `p` is one of a Ray node's processes (other processes this one started while Ray
    was starting, another thread's say, are not stopped with it)."""
    import psutil

    try:
        cmd = " ".join(p.cmdline()) or p.name()
    except psutil.Error:
        return False
    return any(k in cmd for k in _RAY_PROCESSES)


def _kill(procs) -> None:
    import psutil

    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


def resident(address: int, size: int) -> int:
    """Bytes of [address, address + size) in RAM now (mincore(2); size where that cannot say):
    a KV cache's untouched blocks, or a mapped file's pages not yet read, are not."""
    import ctypes
    import os
    import sys

    if size <= 0 or not sys.platform.startswith("linux"):
        return max(size, 0)
    page = os.sysconf("SC_PAGE_SIZE")
    start = address & ~(page - 1)
    pages = (address + size - start + page - 1) // page
    vec = np.zeros(pages, np.uint8)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * page),
                    vec.ctypes.data_as(ctypes.c_void_p)) != 0:
        return size
    return min(int(np.count_nonzero(vec & 1)) * page, size)


def trim_heap() -> None:
    """Give the memory freed after loading back to the system. glibc keeps freed blocks of the
    sizes a load allocates and frees (per-layer transients: dequantized rows, repacked blocks)
    in its heap, where they stay resident; malloc_trim returns them. A no-op off glibc."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def process_memory(pid: int | str = "self", pss: bool = True) -> dict[str, int]:
    """This (or another) process's memory from /proc/PID/status, in bytes: rss (resident now:
    anonymous + file-backed + shared memory), hwm (the peak of rss), and its anon, file and
    shmem parts; and from /proc/PID/smaps_rollup, where it can be read, pss: its proportional
    share (each resident page divided by the processes that map it: a model file's pages, the
    KV pool's shared memory and the libraries counted once over all of them), rss where it
    cannot be read. pss=False skips smaps_rollup (a walk of every mapping: up to milliseconds in a
    large process) for a caller that needs only the status lines."""
    keys = {"VmRSS": "rss", "VmHWM": "hwm", "RssAnon": "anon", "RssFile": "file",
            "RssShmem": "shmem"}
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = line.partition(":")
        if k in keys:
            out[keys[k]] = int(v.split()[0]) * 1024
    if not pss:
        return out
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            k, _, v = line.partition(":")
            if k == "Pss":
                out["pss"] = int(v.split()[0]) * 1024
    except OSError:  # another user's process, or a kernel without it
        out["pss"] = out.get("rss", 0)
    return out


def _anon_bytes() -> int | None:
    """This process's anonymous resident memory (RssAnon), or None where /proc does not say."""
    try:
        return process_memory(pss=False).get("anon")
    except OSError:
        return None


class HeapTrim:
    """`trim_heap` once the process's anonymous memory has grown by `grow` bytes since the last
    trim (or since it went down to its least) and then stopped growing: a served process's
    burst of requests (hundreds of streams at once: their buffers, bodies and events) leaves
    its freed blocks resident in glibc's arenas. After a burst of 400, a model's ingress stayed
    88 MiB up, its scheduler 29 and Serve's proxy 53, until a trim gave back 50, 16 and 30 of
    them (a collection of Python's garbage first gave back nothing more). Trimmed while the
    burst still grew, the rest of it stayed. Calling it costs a read of /proc/self/status
    (microseconds); a trim, a walk of the heap (1-5 ms)."""

    def __init__(self, grow: int = 8 << 20):
        self.grow = grow
        self.level = self.last = _anon_bytes()

    def __call__(self, idle: bool = False) -> bool:
        """Whether it trimmed. idle: the caller knows the work is over (a scheduler with nothing
        to run), so the growth has stopped whatever the last call saw."""
        now = _anon_bytes()
        if now is None or self.level is None:
            return False
        settled = idle or now <= self.last + (1 << 20)
        self.last = now
        if now < self.level + self.grow:
            self.level = min(self.level, now)
            return False
        if not settled:  # still growing: trimmed now, the rest of the burst would stay
            return False
        trim_heap()
        self.level = self.last = _anon_bytes() or now
        return True


def on_idle(seconds: float, fn, busy_share: float = 0.01):
    """A daemon thread that calls `fn()` once a stretch in which this process is idle: at the
    end of the first period of `seconds` in which it took less CPU (every thread's) than
    `busy_share` of the period, and again only after a period that was not. For what a
    process keeps while it works and can give back when it stops (an executor's kept blocks,
    `actors.clib.Library.release_blocks`). An exception in `fn` is the thread's end."""
    import os
    import threading
    import time

    def cpu() -> float:
        t = os.times()
        return t.user + t.system

    def run():
        last, done = cpu(), False
        while True:
            time.sleep(seconds)
            now = cpu()
            idle, last = now - last < busy_share * seconds, now
            if idle and not done:
                fn()
            done = idle

    t = threading.Thread(target=run, name="on-idle", daemon=True)
    t.start()
    return t


def trim_heap_every(seconds: float, then=None, grow: int = 8 << 20):
    """A daemon thread that runs a `HeapTrim` every `seconds` (for a process whose work has no
    idle moment of its own to do it in: a Serve replica's), and `then()` after each trim that
    gave memory back. ctypes lets go of the GIL for the trim; the process's other threads wait
    only where they allocate meanwhile."""
    import threading
    import time

    trim = HeapTrim(grow)

    def run():
        while True:
            time.sleep(seconds)
            if trim() and then is not None:
                try:
                    then()
                except Exception:  # noqa: BLE001 - a courtesy to others; never this thread's end
                    pass

    t = threading.Thread(target=run, name="heap-trim", daemon=True)
    t.start()
    return t
