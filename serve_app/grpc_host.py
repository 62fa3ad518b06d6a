"""Ray Serve's gRPC proxy on one host, and without a traceback in its log for every status code
the application sets (workarounds for Ray Serve 2.60, run in Ray workers)."""
from __future__ import annotations

GRPC_HOST_ENV = "POWERINFER_GRPC_HOST"


def setup_serve_worker():
    """A Ray `worker_process_setup_hook`: make Ray Serve's gRPC proxy listen on the host in
    POWERINFER_GRPC_HOST instead of every interface, and log the status codes the application
    sets in one line.

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
        add = module.add_grpc_address

        def add_grpc_address(server, address: str):
            return add(server, f"{host}:{address.rsplit(':', 1)[1]}")

        module.add_grpc_address = add_grpc_address

    _after_import("ray.serve._private.default_impl", patch)


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
