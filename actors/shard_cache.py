"""What a torch-free actor's loading child packed (`clib.load`), kept on disk so that the next
load of the same shard reads it back instead of starting the child again.

A torch-free cold executor or predictor loads through a child process that imports torch, reads
the model with the torch code and writes the native loop's arguments into a memory file (`pack`).
The child's torch import alone is about 1.5 s of CPU, and the whole child 2.5-3.5 s on two cores
for SmolLM2's shard, where the copy it hands over takes tens of milliseconds. A group is built
again whenever one of its actors dies, and a replica's group whenever the replica does (both with
the same model, bundle and shape), so the first load of a shard keeps what the child said and the
bytes it wrote here, and the later ones copy them into the actor's memory without a child.

An entry is keyed by everything the packed bytes follow from: the role and its arguments (the
plane's segment names, its KV pool's size and the actor's cores left out: they change from one
group to the next and the bytes do not follow from them), the size and modification time of every file those
arguments name (the model, the bundle's files), the project's code and kernel sources, torch's
version, the CPU's flags, the POWERINFER_ settings of the environment and those that hold
torch's own operators to a class (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA). A load that finds no
entry packs as always and stores one; an entry that does not read back whole (a short file, a
bad header) is dropped and the shard packed again. The entries live in
`$POWERINFER_SHARD_CACHE` (default `$XDG_CACHE_HOME/powerinfer/shards`, `0` or `off`: no
cache), a directory only its owner may read or write, at most `$POWERINFER_SHARD_CACHE_GB`
(default 8) GiB together: the oldest used go first. The header is read back with an unpickler
that builds only the few types a child's report holds."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import logging
import mmap
import os
import pickle
import stat
import struct
import sys
from importlib import metadata
from pathlib import Path

log = logging.getLogger("powerinfer")

MAGIC = b"PISHARD1"
ALIGN = 4096  # the packed bytes start at the first multiple of this after the header
HEAD = struct.Struct("<8sQQ")  # magic, the header's length, the packed bytes' length
SUFFIX = ".shard"
# the settings of the cache itself, which the packed bytes do not follow from
OWN = ("POWERINFER_SHARD_CACHE", "POWERINFER_SHARD_CACHE_GB")
# what holds torch's own operators to a lower class than the CPU's (its packing ran on them)
TORCH_ISA = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")


def directory() -> Path | None:
    """Where entries live, or None where the cache is off (or its directory is not ours alone)."""
    where = os.environ.get("POWERINFER_SHARD_CACHE", "")
    if where.lower() in ("0", "off", "no", "false"):
        return None
    if not where:
        try:
            home = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        except RuntimeError:  # (no home directory to be found: no cache)
            return None
        where = Path(home) / "powerinfer" / "shards"
    d = Path(where)
    try:
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = d.stat()
    except OSError as e:
        log.warning("the shard cache is off: %s", e)
        return None
    # (entries are unpickled, with the few types allowed: still, nobody else may write them)
    if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        log.warning("the shard cache is off: %s is not writable by its owner alone", d)
        return None
    return d


def limit_bytes() -> int:
    return int(float(os.environ.get("POWERINFER_SHARD_CACHE_GB", "8")) * (1 << 30))


@functools.cache
def code_digest() -> str:
    """The project's code as a load runs it (its packages' Python files and the kernel's
    sources), torch's version and the CPU's flags, hashed."""
    h = hashlib.sha256()
    here = Path(__file__).resolve().parent
    roots = [here, here.parent / "powerinfer", here.parent / "cluster"]
    for root in roots:
        for f in sorted(root.rglob("*")):
            if f.suffix in (".py", ".h", ".cpp") and "__pycache__" not in f.parts:
                h.update(str(f.relative_to(root.parent)).encode() + b"\0" + f.read_bytes())
    try:
        h.update(metadata.version("torch").encode())
    except metadata.PackageNotFoundError:
        pass
    h.update(sys.version.encode())
    try:
        with open("/proc/cpuinfo") as f:
            h.update(next((ln for ln in f if ln.startswith("flags")), "").encode())
    except OSError:
        pass
    return h.hexdigest()


def named_files(v) -> set:
    """The paths `v` names (Path values, looked for through dataclasses, dicts, sequences and the
    project's objects' attributes)."""
    out: set = set()
    _files(v, out)
    return out


def _files(v, out: set, depth: int = 0):
    if depth > 6 or v is None or isinstance(v, (int, float, bytes, str)):
        return
    if isinstance(v, Path):
        out.add(v)
    elif dataclasses.is_dataclass(v) and not isinstance(v, type):
        for f in dataclasses.fields(v):
            _files(getattr(v, f.name), out, depth + 1)
    elif isinstance(v, dict):
        for x in v.values():
            _files(x, out, depth + 1)
    elif isinstance(v, (list, tuple, set, frozenset)):
        if len(v) < 10_000:
            for x in v:
                _files(x, out, depth + 1)
    elif hasattr(v, "__dict__") and type(v).__module__.startswith(("powerinfer", "actors")):
        _files(vars(v), out, depth + 1)


def _stamps(paths: set) -> list:
    """(path, size, mtime) of every file under `paths` (a directory's files walked)."""
    out = []
    for p in sorted(paths, key=str):
        files = sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else [p]
        for q in files:
            try:
                st = q.stat()
            except OSError:
                continue
            out.append((str(q), st.st_size, st.st_mtime_ns))
    return out


def key(role: str, kwargs: dict) -> str:
    """The entry's name for a load of `role` with `kwargs` (see the module's docstring)."""
    args = dict(kwargs)
    args.pop("cores", None)
    spec = args.get("spec")
    if dataclasses.is_dataclass(spec):
        # (the KV pool's size too, sized from the memory free at the start: a packed KV cache
        # is its shape, its blocks a `Slot`)
        args["spec"] = dataclasses.replace(spec, owner=0, group="", paths={}, num_blocks=0)
    model = args.get("model")
    if dataclasses.is_dataclass(model) and hasattr(model, "files"):
        # (a `Sealed` table: its bytes differ from one process to the next, its sets' order
        # with them, but it follows from the files it names and the code)
        args["model"] = (model.args, model.files)
    files = named_files(args)
    env = sorted((k, v) for k, v in os.environ.items()
                 if (k.startswith("POWERINFER_") and k not in OWN) or k in TORCH_ISA)
    h = hashlib.sha256(code_digest().encode())
    h.update(role.encode())
    h.update(pickle.dumps((sorted(args.items()), env, _stamps(files)), protocol=4))
    return h.hexdigest()[:40]


class _Header(pickle.Unpickler):
    """A child's report as an entry keeps it: built from the types such a report holds only."""

    ALLOWED = {("actors.packed", "Packed"), ("actors.packed", "Mapped"), ("actors.packed", "Slot"),
               ("actors.packed", "Zeros"),
               ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"),
               ("pathlib", "PosixPath"), ("pathlib", "Path")}

    def find_class(self, module, name):
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"a shard cache entry names {module}.{name}")


def start(header: int) -> int:
    """Where an entry's packed bytes start, after a header of that many bytes."""
    return -(-(HEAD.size + header) // ALIGN) * ALIGN


def fetch(name: str) -> tuple[dict, mmap.mmap | None] | None:
    """(the child's report, its packed bytes in anonymous memory of this process, on 2 MiB
    pages where it can; None for a report of why the role needs torch) of the entry `name`, or
    None where there is none. An entry that does not read back whole, or that names a kernel
    library no longer there, is removed (and None); one removed by another process as it is
    read is read whole all the same (its file stays open)."""
    d = directory()
    if d is None:
        return None
    path = d / (name + SUFFIX)
    try:
        f = open(path, "rb")
    except OSError:
        return None
    m = None
    try:
        with f:
            magic, n, size = HEAD.unpack(f.read(HEAD.size))
            if magic != MAGIC or n > 1 << 26:
                raise ValueError("not an entry of this version")
            got = _Header(io.BytesIO(f.read(n))).load()
            if not isinstance(got, dict) or got.get("size", size) != size:
                raise ValueError("its header does not match its size")
            if got.get("library") and not os.path.exists(got["library"]):
                raise ValueError(f"its kernel library {got['library']} is gone")
            at0, held = start(n), os.fstat(f.fileno()).st_size
            if held != at0 + size:
                raise ValueError(f"it holds {held} bytes, not {at0 + size}")
            if "why" in got:
                return got, None
            m = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if hasattr(mmap, "MADV_HUGEPAGE"):
                m.madvise(mmap.MADV_HUGEPAGE)
            view, at = memoryview(m), 0
            try:
                while at < size:
                    got_n = os.preadv(f.fileno(), [view[at:min(size, at + (64 << 20))]], at0 + at)
                    if got_n <= 0:
                        raise ValueError("it ended early")
                    at += got_n
            finally:
                view.release()
    except Exception as e:  # noqa: BLE001 - a bad entry is packed again
        log.warning("shard cache entry %s dropped: %s", path.name, e)
        if m is not None:
            m.close()
        path.unlink(missing_ok=True)
        return None
    try:
        os.utime(path)  # (used: the last to go)
    except OSError:
        pass
    return got, m


def store(name: str, got: dict, memory: mmap.mmap | None, size: int):
    """Keep the child's report and its packed bytes (None: a report of why the role needs torch,
    no bytes) as the entry `name` (written aside, then renamed: a reader sees a whole entry or
    none), then the oldest entries removed past the limit. A failure to write is logged and the
    load goes on."""
    d = directory()
    if d is None or size > limit_bytes():
        return
    head = pickle.dumps(got, protocol=4)
    at0 = start(len(head))
    tmp = d / f".{name}.{os.getpid()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            first = HEAD.pack(MAGIC, len(head), size) + head
            os.pwrite(fd, first.ljust(at0, b"\0"), 0)
            if memory is not None:
                view, at = memoryview(memory), 0
                try:
                    while at < size:
                        at += os.pwrite(fd, view[at:min(size, at + (64 << 20))], at0 + at)
                finally:
                    view.release()
            os.ftruncate(fd, at0 + size)
        finally:
            os.close(fd)
        os.replace(tmp, d / (name + SUFFIX))
    except OSError as e:
        log.warning("the shard cache could not keep %s: %s", name, e)
        tmp.unlink(missing_ok=True)
        return
    evict(d, limit_bytes())


def evict(d: Path, limit: int):
    """The least recently used entries removed until the rest fit in `limit` bytes."""
    entries = []
    for p in d.glob("*" + SUFFIX):
        try:
            st = p.stat()
        except OSError:
            continue
        entries.append((st.st_mtime_ns, st.st_size, p))
    total = sum(s for _, s, _ in entries)
    for _, s, p in sorted(entries, key=lambda e: e[0]):
        if total <= limit:
            break
        p.unlink(missing_ok=True)
        total -= s
