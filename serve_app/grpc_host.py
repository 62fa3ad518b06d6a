"""Ray Serve's gRPC proxy on one host, without a traceback in its log for every status code the
application sets, and cancelling a stream whenever its client goes away (workarounds for Ray
Serve 2.60, run in the proxy's process)."""
from __future__ import annotations

GRPC_HOST_ENV = "POWERINFER_GRPC_HOST"


def setup_serve_worker():
    """A Ray `worker_process_setup_hook`: make Ray Serve's gRPC proxy listen on the host in
    POWERINFER_GRPC_HOST instead of every interface, and log the status codes the application
    sets in one line. On a node of a local instance (its address 127.0.0.1: `powerinfer.compat.
    loopback_node`), the replicas' own gRPC servers listen on 127.0.0.1 too.

    Ray Serve 2.60 binds its gRPC proxy to `[::]:PORT` (`ray.serve._private.grpc_util.
    start_grpc_server` through `default_impl.add_grpc_address`) and has no option for the host,
    while its HTTP proxy honours `http_options.host`. The proxy runs in a worker process of the
    job, so this hook, run in every worker, rewrites the address in `add_grpc_address` once that
    module is imported (workers that never import Ray Serve pay nothing). It lives here, not in
    `powerinfer.compat`, because importing `powerinfer` imports torch, and torch imported before
    Ray sets a worker's OMP_NUM_THREADS sizes its thread pools for every core (a 17x slower
    prefill in an executor pinned to one core)."""
    import os

    host = os.environ.get(GRPC_HOST_ENV)
    if not host:
        return

    def patch(module):
        import logging
        logging.getLogger("ray.serve").addFilter(_status_codes_in_one_line)
        _trim_heap_after_growth()
        add = module.add_grpc_address

        def add_grpc_address(server, address: str):
            return add(server, f"{host}:{address.rsplit(':', 1)[1]}")

        module.add_grpc_address = add_grpc_address

    _after_import("ray.serve._private.default_impl", patch)
    _after_import("ray.serve._private.replica", _replicas_on_the_nodes_address)


def _replicas_on_the_nodes_address(module):
    """Each Serve 2.60 replica serves the other deployments' calls on a gRPC server of its own
    at `[::]:0` (`Replica._on_initialized`), every interface whatever the node's address; the
    callers reach it at the node's address. On a loopback node, bind that address: a local
    instance then listens on nothing the network reaches (Ray's token guards the server
    either way)."""
    add = module.add_port_to_grpc_server

    def add_port_to_grpc_server(server, address: str):
        import ray
        node = ray.util.get_node_ip_address()
        if address.startswith("[::]:") and node.startswith("127."):
            address = f"{node}:{address.rsplit(':', 1)[1]}"
        return add(server, address)

    module.add_port_to_grpc_server = add_port_to_grpc_server


TRIM_EVERY_S, TRIM_GROWTH = 30.0, 4 << 20


def _trim_heap_after_growth(every_s: float = TRIM_EVERY_S, growth: int = TRIM_GROWTH):
    """In a Serve process (the proxy, the controller, the ingress and model replicas), a thread
    that gives the heap's freed pages back to the system: every `every_s` s, where the process
    has grown by `growth` bytes over the least it has held since its start and its heap holds at
    least that much freed (glibc's mallinfo2 and malloc_trim); where a trim gives little back,
    what grew is in use, and the floor rises to it.

    A burst of requests leaves its buffers freed but resident: 400 requests at once took Serve's
    proxy from 85 to 101 MiB and the ingress from 91 to 116, and a trim gave back about half
    (93 and 103; the rest is Python's own arenas, which it frees as they empty). Without it,
    each burst's high-water mark stays for the life of the process. A no-op off glibc."""
    import ctypes
    import os
    import threading
    import time

    try:
        libc = ctypes.CDLL("libc.so.6")
        trim, info = libc.malloc_trim, libc.mallinfo2
    except (OSError, AttributeError):  # (mallinfo2: glibc 2.33 and later)
        return
    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost")]

    info.restype = MallInfo2
    page = os.sysconf("SC_PAGE_SIZE")

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page

    def run():
        time.sleep(every_s)
        floor = rss()  # settled after its start
        while True:
            time.sleep(every_s)
            now = rss()
            # grown since the least it has held, and the heap holds that much freed (a trim in
            # the middle of a burst leaves the floor: the burst's end is trimmed too)
            if now > floor + growth and info().fordblks >= growth:
                trim(0)  # (tens of ms on a fragmented heap, holding its locks)
                after = rss()
                if now - after < growth // 2:  # what grew is in use: the floor from now
                    floor = after
                now = after
            floor = min(floor, now)

    threading.Thread(target=run, name="powerinfer-heap-trim", daemon=True).start()


def add_inference_servicer(servicer, server):
    """The gRPC servicer function named in the Serve config (`grpc_options.
    grpc_servicer_functions`): registers powerinfer.v1.Inference and grpc.health.v1.Health on
    the proxy's server, with each streaming method behind `_always_cancellable` and each method
    refusing bytes that do not parse (`_malformed_refused`).

    Ray Serve's proxy turns its server's methods into calls to the application; it cancels the
    call when the client goes away only if grpc's cancellation reaches the proxy while it waits
    for the application's next message. When grpc notices the hang-up while writing a message
    instead, it closes the handler's generator, the proxy swallows the GeneratorExit ("async
    generator ignored GeneratorExit" in its log) and the generation runs on to `max_tokens`,
    holding its batch slot (2 streams in 30 cancelled after 1-5 messages, measured)."""
    import logging

    from grpc_health.v1.health_pb2_grpc import add_HealthServicer_to_server

    from powerinfer.v1.inference_pb2_grpc import add_InferenceServicer_to_server

    add_InferenceServicer_to_server(servicer, _StreamsCancellable(server))
    # the standard health service beside it (the ingress's Check and Watch), for Kubernetes
    # gRPC probes, grpc_health_probe and load balancers
    add_HealthServicer_to_server(servicer, _StreamsCancellable(server))
    logging.getLogger("asyncio").addFilter(_no_cancelled_request_traceback)


def _no_cancelled_request_traceback(record) -> bool:
    """The proxy leaves the read of a cancelled stream's next message unawaited, and asyncio
    logs its RequestCancelledError with a traceback for every stream a client cancels."""
    return "exception=RequestCancelledError(" not in record.getMessage()


class _StreamsCancellable:
    """The proxy's server as the generated registration code sees it: Serve replaces the method
    handlers in the table it is given (in place), then each streaming handler is wrapped. The
    registered-method table (a lookup shortcut in grpc) is not filled, so every call goes
    through the wrapped table."""

    def __init__(self, server):
        self._server = server

    def add_generic_rpc_handlers(self, handlers):
        self._server.add_generic_rpc_handlers(handlers)
        for handler in handlers:
            table = getattr(handler, "_method_handlers", None)
            if table is None:  # another grpc: registered as Serve made them
                import logging
                logging.getLogger(__name__).warning(
                    "gRPC streams are cancelled only as Ray Serve does it (no method table in %r)",
                    handler)
                continue
            for name, method in table.items():
                if method.unary_stream is not None:
                    method = method._replace(unary_stream=_always_cancellable(method.unary_stream))
                table[name] = _malformed_refused(method)

    def add_registered_method_handlers(self, service_name, method_handlers):
        pass

    def __getattr__(self, name):
        return getattr(self._server, name)


class _Malformed:
    """A request message whose bytes did not parse, and why."""

    def __init__(self, why: str):
        self.why = why


def _malformed_refused(method):
    """A method whose request bytes that do not parse get INVALID_ARGUMENT naming the message
    type (grpc answers UNKNOWN for a deserializer's error, a code clients may retry), answered
    in the proxy: the application never sees them."""
    import grpc
    from google.protobuf.message import DecodeError

    parse = method.request_deserializer
    if parse is None or method.request_streaming:
        return method

    def lenient(data: bytes):
        try:
            return parse(data)
        except DecodeError as e:
            return _Malformed(f"the request is not a valid message of this method's type: {e}")

    def refusing(behaviour):
        async def handler(request, context):
            if isinstance(request, _Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.why)
            return await behaviour(request, context)
        return handler

    # (Serve fills all four behaviours; grpc calls the one the method's streaming flags name)
    kind = "unary_stream" if method.response_streaming else "unary_unary"
    return method._replace(request_deserializer=lenient,
                           **{kind: refusing(getattr(method, kind))})


def _always_cancellable(stream):
    """A streaming handler that reads `stream` in a task of its own and writes its messages
    itself (grpc's reader/writer form, a coroutine, so grpc's cancellation always lands in this
    frame). The reading task is always waiting for the next message (handing one over never
    waits), so cancelling it lands where Serve turns it into a cancellation of the call; it
    is awaited before the handler returns, while the call is still alive (the proxy reads the
    call's peer when it logs the request; after the call is released that is a crash)."""
    import asyncio

    async def handler(request, context):
        messages: asyncio.Queue = asyncio.Queue()  # tokens are small; max_tokens bounds it
        end = object()

        async def read():
            try:
                async for message in stream(request, context):
                    messages.put_nowait(message)
            except BaseException as e:  # handed to the handler, which raises it in grpc's task
                messages.put_nowait(e)
            else:
                messages.put_nowait(end)

        reader = asyncio.ensure_future(read())
        try:
            while (message := await messages.get()) is not end:
                if isinstance(message, BaseException):
                    raise message
                await context.write(message)
        finally:
            if not reader.done():
                reader.cancel()
                await asyncio.wait([reader])

    return handler


def _status_codes_in_one_line(record) -> bool:
    """The proxy logs each status code a gRPC method sets (UNAUTHENTICATED, NOT_FOUND...) as an
    error with a traceback; it is the answer the application chose, so one INFO line says it."""
    if record.getMessage().startswith("Request failed with user-set gRPC status code"):
        record.exc_info, record.exc_text = None, None
        record.levelno, record.levelname = 20, "INFO"
    return True


def _after_import(name: str, then):
    """Call `then(module)` right after the module `name` is first imported in this process."""
    import importlib.abc
    import importlib.util
    import sys

    if name in sys.modules:
        then(sys.modules[name])
        return

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname != name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(fullname)
            exec_module = spec.loader.exec_module

            def exec_then(module):
                exec_module(module)
                then(module)

            spec.loader.exec_module = exec_then
            return spec

    sys.meta_path.insert(0, Finder())
