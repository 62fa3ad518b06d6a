"""`powerinfer serve`: the application in the foreground.

Starts (or joins, with RAY_ADDRESS) a Ray instance with token authentication on, Ray Serve's
HTTP and gRPC proxies on one host (127.0.0.1 unless told otherwise), and the application; prints
the addresses once every model has loaded (or failed to, which is reported while the others
serve); serves until Ctrl-C or SIGTERM; then refuses new requests (503) while those in flight
finish, up to `--drain-timeout` seconds (`stopping`: those still running then end with an error
that says so), deletes the application and stops the Ray instance it started, which leaves no
Ray process and no shared-memory segment behind.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path

from powerinfer.config import DTYPE_HELP, ISA_HELP, gib
from powerinfer.errors import ConfigError
from powerinfer.cpu import ISAS
from powerinfer.formats.loader import DEFAULT_MODEL, resolve_model

from .settings import ServeSettings

APP_NAME = "powerinfer"
# ports the Ray instance a server starts listens on by default: the GCS, the dashboard, Ray
# Client and the dashboard agent (a port picked as 52365 once lost it to the agent)
RAY_PORTS = {6379, 8265, 10001, 52365}
REQUEST_TIMEOUT_S = 600.0  # Serve's proxies cancel a request after this (a stream included)
# at a stop, the responses in flight have this long to finish (Serve's own default grace; within
# Kubernetes' 30 s between its SIGTERM and its SIGKILL, with time left for Ray's stop)
DRAIN_S = 20.0
LOAD_POLL_S = 1.0
LOAD_NOTE_S = 15.0  # a line this often while the models load
# at start, a model whose replica is not answering (its process died: Serve starts another) or
# whose group is being rebuilt is waited for this long at a stretch before it is reported down
UNAVAILABLE_WAIT_S = 120.0


def free_port() -> int:
    """A free local port that no process can take before a server started next binds it (for
    tests and benchmarks that start servers): below Linux's range for ports handed out to binds
    of port 0 (every Ray process's own gRPC servers bind those: one took a test's HTTP port
    before its server did), above Ray's worker ports (10002-19999), none of RAY_PORTS."""
    import random
    import socket

    ranges = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low = int(ranges.read_text().split()[0]) if ranges.exists() else 32768
    while True:
        port = random.randrange(20000, max(low, 20001))
        if port in RAY_PORTS:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port


@dataclass(frozen=True, slots=True)
class Frontend:
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int = 9000
    log_requests: bool = False
    request_timeout_s: float = REQUEST_TIMEOUT_S  # end to end, streams included (0: none)
    drain_s: float = DRAIN_S  # at a stop, the time the responses in flight have to finish

    @property
    def loopback(self) -> bool:
        """Whether the HTTP front end listens on a loopback address only."""
        import ipaddress
        try:
            return self.host == "localhost" or ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

    def check_ports(self):
        """ConfigError where the HTTP or gRPC port is taken on the host. Serve's proxy binds
        with SO_REUSEPORT, so a second server on the ports of a running one started, shared
        them with it (the kernel splitting connections between the two) and reported the first
        one's models as its own."""
        import socket

        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        for port, what, flag in ((self.port, "HTTP", "--port"),
                                 (self.grpc_port, "gRPC", "--grpc-port")):
            with socket.socket(family, socket.SOCK_STREAM) as s:
                # (not SO_REUSEPORT; SO_REUSEADDR passes a stopped server's TIME_WAIT only)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind((self.host, port))
                except OSError as e:
                    raise ConfigError(f"the {what} port {port} on {self.host} is taken "
                                      f"({e.strerror}): another server runs there, or pick "
                                      f"another with {flag}") from None

    @property
    def local_url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.port}"


def check_stubs():
    try:
        import powerinfer.v1.inference_pb2_grpc  # noqa: F401
    except ImportError as e:
        raise ConfigError("the gRPC stubs are not generated: run `make protos` (make run and "
                          f"make test do it) ({e})") from None


def say(*parts, **kw):
    """A line on the console; none where nothing reads it any more (a pipe whose reader the same
    signal stopped: the stop must go on, where a BrokenPipeError ended its watch)."""
    try:
        print(*parts, **kw, flush=True)
    except OSError:
        pass


CONTROL_LOOP_ENV, CONTROL_LOOP_S = "RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "1.0"
# How Serve's processes pass their calls (the proxy's to the ingress, the ingress's to the model
# deployments) and the calls' results and stream chunks: over the gRPC server every replica
# already runs for them (loopback on a local instance, Ray's token required), not as Ray tasks
# with their results as objects (Ray Serve 2.60's default; its source calls the setting one for
# tests, and its RAY_SERVE_THROUGHPUT_OPTIMIZED turns it on). An HTTP request's body is still
# read through Ray.
# With SmolLM2 on a 2-core VM, the ingress and the proxy took 0.31-0.37 ms of CPU a streamed
# token at 32 streams against 0.63-0.67, and the server decoded 1.07-1.40x as many tokens a
# second from 8 streams up, one stream alike (BENCHMARKS.md, "Serve's hops over its replicas'
# gRPC servers"). Each replica's code on its process's own loop as well (two more of Serve's
# throughput settings) saved no more, and its time to the first token was longer. An
# operator's own setting stays (the environment `powerinfer serve` starts in). A message on
# that server may be as long as gRPC allows (2 GiB), as a Ray task's result was: at Serve's 4
# MiB a whole response past it (16 choices of 700 tokens with their top logprobs, 5 MB) was a
# 500 where Ray's tasks had carried it.
SERVE_TRANSPORT_ENV = {"RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
                       "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(2**31 - 1)}


def serve_forever(settings: ServeSettings, front: Frontend, demo: bool = False) -> int:
    import ray
    from ray import serve
    from ray.serve.config import gRPCOptions
    from ray.serve.exceptions import RayServeException

    from cluster.topology import numa_resources
    from powerinfer.compat import LOOPBACK_SWITCH, ray_init

    from .app import GRPC_SERVICER, build
    from .grpc_host import GRPC_HOST_ENV
    from .stopping import clear

    check_stubs()
    joined = bool(os.environ.get("RAY_ADDRESS"))
    # Serve's controller runs its control loop every 0.1 s by default, 5-6% of a core on an
    # idle 2-core VM; once a second it takes 2% (a replica that dies is replaced up to 0.9 s
    # later; health checks run every 10 s anyway). The operator's own setting stays, for it and
    # for SERVE_TRANSPORT_ENV's alike.
    defaults = {CONTROL_LOOP_ENV: CONTROL_LOOP_S, **SERVE_TRANSPORT_ENV}
    env = {GRPC_HOST_ENV: front.host, **{k: os.environ.get(k, v) for k, v in defaults.items()}}
    if not joined:  # (this host's proxy binds them)
        front.check_ports()
    # SIGTERM stops the server as Ctrl-C does (a handler that only raises takes no lock that
    # the interrupted code may hold), from the start of Ray's on: `ray_init` stops what it
    # started when it is interrupted
    signal.signal(signal.SIGTERM, _interrupt)
    ray_init(runtime_env={"worker_process_setup_hook": "serve_app.grpc_host.setup_serve_worker",
                          "env_vars": env},
             resources=numa_resources())  # a local instance advertises the NUMA nodes
    signal.signal(signal.SIGTERM, _interrupt)  # (again: ray.init sets its own, which exits)
    try:  # (from here a stop, at any point, stops what was started: it left Ray running)
        # the cluster's address, for an operator's `ray status` or another node's `ray start`
        # (and for a client that joins this server's instance rather than another one on the
        # machine); a local instance is this machine's alone, joined with Ray's loopback switch
        gcs = ray.get_runtime_context().gcs_address
        note = "" if joined else (
            " (token authentication on, this machine's alone; a process here joins it with "
            f"RAY_AUTH_MODE=token {LOOPBACK_SWITCH}=0, as in `RAY_AUTH_MODE=token "
            f"{LOOPBACK_SWITCH}=0 ray status --address {gcs}`)")
        say(f"Ray: {'joined the cluster' if joined else 'a local instance'} at {gcs}{note}")
        logging_config = {"enable_access_log": front.log_requests}
        clear(APP_NAME)  # (a stop of a server before this one on the cluster, not this one's)
        timeout = front.request_timeout_s or None
        serve.start(http_options={"host": front.host, "port": front.port,
                                  "request_timeout_s": timeout},
                    grpc_options=gRPCOptions(port=front.grpc_port, request_timeout_s=timeout,
                                             grpc_servicer_functions=[GRPC_SERVICER]),
                    logging_config=logging_config)
        serve.run(build(settings, local_only=front.loopback), name=APP_NAME, route_prefix="/",
                  blocking=False, logging_config=logging_config)
        statuses = _wait_loaded(front)
        _wait_replicas(settings)
        ready = [s for s in statuses if s["status"] == "ready"]
        costs = {}
        for s in statuses:
            line = f"  {s['id']}: {s['status']}"
            line += f" ({s['error']})" if s.get("error") else f", context {s['max_model_len']}"
            if s["status"] == "ready":
                costs[s["id"]], memory = _model_memory(settings, s["id"])
                line += "\n" + memory
            say(line)  # (one write: Ray's forwarded logs go between lines, not into these)
        if not ready:
            say("error: no model loaded", file=sys.stderr)
            return 1
        if not joined:  # this host's processes are this server's
            say(_host_memory(sum(costs.values())))
        say(f"HTTP (OpenAI API): {front.local_url}/v1   gRPC (powerinfer.v1.Inference): "
            f"{front.local_url.split('//')[1].rsplit(':', 1)[0]}:{front.grpc_port}")
        say("try:\n  " + _curl(front, settings, ready[0]["id"]))
        if demo:
            _demo(front, settings, ready[0]["id"])
        say("serving; Ctrl-C stops")
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        say("stopping...")
        watch = None if joined else _exit_if_the_gcs_goes(_gcs_address())
        try:
            with contextlib.suppress(RayServeException):  # (stopped before Serve started)
                _drain(front.drain_s)
                # (the application's replicas and groups stopped; Serve's controller and proxies
                # go with a local instance: `serve.shutdown` there killed the controller under
                # this process's own calls to it, and Ray logged each as an actor killed)
                serve.delete(APP_NAME)
        finally:
            if watch is not None:
                watch.set()
            ray.shutdown()
            say("stopped")


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _gcs_address() -> str | None:
    import ray

    try:
        return ray.get_runtime_context().gcs_address
    except Exception:  # noqa: BLE001 - (no instance started)
        return None


def _exit_if_the_gcs_goes(address: str | None) -> threading.Event | None:
    """While the application stops: a thread that ends this process if the local instance's GCS
    (at `address`, host:port) stops taking connections. A signal to the server's whole process
    group (`kill -- -PGID`, a service manager's stop of every process in its unit) stops Ray's
    own processes with this one; Serve's calls then waited a minute for the GCS, and the process
    exited with Ray's error. Ray's processes go with this one (they die with their parent). Set
    the event to end the watch."""
    import socket

    if address is None:
        return None
    host, _, port = address.rpartition(":")
    done = threading.Event()

    def watch():
        while not done.wait(0.5):
            try:
                with socket.create_connection((host, int(port)), timeout=2):
                    continue
            except OSError:
                pass
            if not done.is_set():
                try:
                    say("  Ray's own processes were stopped too (the signal reached this "
                        "server's whole process group), so the generations in flight could not "
                        "finish: send the signal to this process alone to let them")
                finally:
                    os._exit(0)

    threading.Thread(target=watch, name="gcs-watch", daemon=True).start()
    return done


def _drain(grace_s: float):
    """The application's stop (`stopping`): announced to its ingress replicas, which refuse new
    requests from then; waits until none has a response in flight, at most `grace_s` (when the
    replicas end those left with an error that says so) and a moment more. A second Ctrl-C or
    SIGTERM ends them at once."""
    from ray import serve

    from .stopping import POLL_S, announce, clear, left

    try:
        app = serve.status().applications.get(APP_NAME)
        ingress = app.deployments.get("Ingress") if app else None
        replicas = sum(n for state, n in ingress.replica_states.items()
                       if str(getattr(state, "value", state)) == "RUNNING") if ingress else 0
    except Exception:  # noqa: BLE001 - no controller to ask: nothing to drain
        replicas = 0
    if not replicas:
        return
    announce(APP_NAME, grace_s)
    deadline = time.monotonic() + grace_s + 2 * POLL_S + 1.0  # (their reports' delay)
    said = False
    try:
        while time.monotonic() < deadline:
            time.sleep(POLL_S / 2)
            counts = left(APP_NAME)
            running = sum(counts.values())
            if len(counts) >= replicas and not running:
                return
            if running and not said:
                said = True
                say(f"  {running} generation{'s' * (running != 1)} in flight (a request's "
                    f"choices each): given up to {grace_s:g} s to finish, new requests refused "
                    "(Ctrl-C again ends them now)")
    except KeyboardInterrupt:
        say("  ending the responses in flight now")
        announce(APP_NAME, 0.0)
        deadline = time.monotonic() + 2 * POLL_S + 1.0
        while time.monotonic() < deadline and any(left(APP_NAME).values()):
            time.sleep(POLL_S / 2)
    finally:
        clear(APP_NAME)


def _get(url: str, timeout: float = 10.0) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _wait_loaded(front: Frontend) -> list[dict]:
    """Poll /health until every model is ready or has failed to load. A model that is not
    answering or is rebuilding its group is waited for up to UNAVAILABLE_WAIT_S at a stretch: a
    replica that died as the server started is replaced by Serve, and the server must not give
    up on it ("no model loaded") while it is."""
    down_since: dict[str, float] = {}
    start = said = time.monotonic()
    while True:
        statuses = []
        try:
            _, body = _get(front.local_url + "/health")
            statuses = body.get("models", [])
            now, waiting = time.monotonic(), False
            for s in statuses:
                if s["status"] in ("unavailable", "rebuilding"):
                    waiting |= now - down_since.setdefault(s["id"], now) < UNAVAILABLE_WAIT_S
                else:
                    down_since.pop(s["id"], None)
                    waiting |= s["status"] == "loading"
            if statuses and not waiting:
                return statuses
        except (urllib.error.URLError, OSError, ValueError):
            pass  # the proxy or the ingress is still starting
        if time.monotonic() - said >= LOAD_NOTE_S:  # (a first start said nothing for a minute)
            said = time.monotonic()
            left = [s["id"] for s in statuses if s["status"] != "ready" and "error" not in s]
            what = "loading " + ", ".join(left) if left else "starting the models' replicas"
            say(f"  {what}: {said - start:.0f} s")
        time.sleep(LOAD_POLL_S)


def _wait_replicas(settings: ServeSettings, timeout_s: float = 120.0):
    """Every replica of a model with several past loading: /health asks one replica of each
    model a call, so it can say "ready" while another replica still loads and would answer a
    request with 503. Its status calls reach the replicas at random until each has answered."""
    from ray import serve

    for m in settings.models:
        if m.replicas < 2:
            continue
        handle = serve.get_deployment_handle(f"Model:{m.name}", app_name=APP_NAME)
        seen: dict[str, str] = {}
        deadline = time.time() + timeout_s
        while time.time() < deadline and (len(seen) < m.replicas or "loading" in seen.values()):
            st = handle.status.remote().result(timeout_s=30)
            seen[st.get("replica_id", "")] = st["status"]
            if st["status"] == "loading":
                time.sleep(LOAD_POLL_S)
        if len(seen) < m.replicas or "loading" in seen.values():
            say(f"  {m.name}: {sum(v != 'loading' for v in seen.values())} of {m.replicas} "
                f"replicas answered as loaded within {timeout_s:.0f} s; the others are still "
                "loading or not placed")


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def _model_memory(settings: ServeSettings, name: str) -> tuple[int, str]:
    """A ready model's host memory (a replica's, `ModelServer.memory`): its bytes (every
    replica's, as much as the one asked) and a line with its processes' PSS, of which the
    weights and the KV cache they hold, and each process's own cost beside them."""
    from ray import serve

    replicas = next((m.replicas for m in settings.models if m.name == name), 1)
    try:
        procs = serve.get_deployment_handle(f"Model:{name}", app_name=APP_NAME).memory.remote() \
            .result(timeout_s=60)
    except Exception as e:  # noqa: BLE001 - a report: the model serves either way
        return 0, f"    memory: not reported ({type(e).__name__}: {str(e).strip()[:200]})"
    total = sum(p["pss"] for p in procs.values())
    weights, kv, kv_now = (sum(p[k] for p in procs.values())
                           for k in ("weight", "kv", "kv_resident"))
    own = ", ".join(f"{k} {_gib(max(p['pss'] - p['weight_resident'] - p['kv_resident'], 0))}"
                    for k, p in procs.items())
    per = f" a replica ({replicas} replicas)" if replicas > 1 else ""
    return total * replicas, (
        f"    memory{per}: {_gib(total)} GiB now (PSS of its {len(procs)} processes), "
        f"{_gib(total - kv_now + kv)} with its KV cache full: weights {_gib(weights)}, KV cache "
        f"{_gib(kv_now)} in use of {_gib(kv)}, each process's own {own}")


def _host_memory(models: int) -> str:
    """The host's total for this server: the PSS of this process and every process it started
    (Ray's GCS, raylet and agents, Serve's controller and proxy, the replicas, the groups)."""
    import psutil

    from cluster.topology import process_memory

    procs, total = [psutil.Process(), *psutil.Process().children(recursive=True)], 0
    for p in procs:
        try:
            m = process_memory(p.pid)
            total += m["pss"]
        except (OSError, psutil.Error):  # ended meanwhile
            pass
    return (f"  host: {_gib(total)} GiB in {len(procs)} processes (PSS): the models "
            f"{_gib(models)}, Ray, Serve and this process {_gib(max(total - models, 0))}")


def _curl(front: Frontend, settings: ServeSettings, model: str) -> str:
    """A request to paste; with an API key, the variable it came from, else a placeholder (the
    key itself is not printed: logs are read by more people than hold it)."""
    from_env = settings.api_key and os.environ.get("POWERINFER_API_KEY") == settings.api_key
    key = "$POWERINFER_API_KEY" if from_env else "KEY"
    auth = f' -H "Authorization: Bearer {key}"' if settings.api_key else ""
    note = "   (KEY: the server's API key)" if settings.api_key and not from_env else ""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}]})
    return (f"curl {front.local_url}/v1/chat/completions -H 'Content-Type: application/json'"
            f"{auth} -d '{body}'{note}")


def _demo(front: Frontend, settings: ServeSettings, model: str):
    """One chat request through the server's own HTTP endpoint."""
    question = "What is the capital of France? Answer in one sentence."
    body = json.dumps({"model": model, "max_tokens": 48, "temperature": 0,
                       "messages": [{"role": "user", "content": question}]}).encode()
    req = urllib.request.Request(front.local_url + "/v1/chat/completions", body,
                                 {"Content-Type": "application/json"})
    if settings.api_key:
        req.add_header("Authorization", f"Bearer {settings.api_key}")
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            answer = json.loads(r.read())
    except urllib.error.HTTPError as e:
        say(f"demo request failed: HTTP {e.code}: {e.read().decode(errors='replace')}")
        return
    usage = answer["usage"]
    say(f"asked {model}: {question}\nanswer: {answer['choices'][0]['message']['content']!r}\n"
        f"({usage['completion_tokens']} tokens in {time.perf_counter() - t0:.2f} s)")


def add_command(sub):
    """`powerinfer serve` (registered in the `powerinfer.commands` entry points)."""
    from powerinfer.cli import seconds

    p = sub.add_parser("serve", help="serve models over an OpenAI-compatible HTTP API and gRPC "
                                     "(Ray Serve, in the foreground)")
    p.add_argument("--model", "-m", default=None,
                   help=f"GGUF file, Hugging Face folder or installed model name (default "
                        f"{DEFAULT_MODEL}); or give --config")
    p.add_argument("--name", default=None, help="the model's name in requests (default: its "
                                                 "short name or file name)")
    p.add_argument("--config", default=None, help="YAML file listing the models to serve")
    p.add_argument("--bundle", default="", help="sparsity bundle of --model")
    p.add_argument("--input-sparsity", default="auto", metavar="auto|off|BUNDLE",
                   help="input sparsity in the projections (TEAL, `powerinfer calibrate-input`): "
                        "auto: the --bundle's thresholds where it has them; off; or a bundle's "
                        "(/metrics: powerinfer:input_sparsity_realised, per request)")
    p.add_argument("--no-input-sparsity", dest="input_sparsity", action="store_const", const="off",
                   help="the same as --input-sparsity off")
    p.add_argument("--host", default="127.0.0.1", help="address of the HTTP and gRPC front ends")
    p.add_argument("--port", type=int, default=8000, help="HTTP port")
    p.add_argument("--grpc-port", type=int, default=9000, help="gRPC port")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (default: $POWERINFER_API_KEY)")
    p.add_argument("--cold-executors", type=int, default=None,
                   help="cold-neuron executors a model (default 1, or 0 where its group would "
                        "have fewer cores than executors); 0: one executor with the whole model "
                        "(a dense model on the CPU: a process fewer, about 0.25 GiB less a model)")
    p.add_argument("--device", default=None, choices=["cpu", "cuda", "auto"],
                   help="default: auto (the GPU where there is one) with --vram-budget, else cpu")
    p.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    p.add_argument("--cpu-isa", default="auto", choices=["auto", *ISAS], help=ISA_HELP)
    p.add_argument("--vram-budget", type=gib, default=0.0, metavar="GB",
                   help="GPU memory the hot neurons' placement may use (with --device cuda; the "
                        "bundle MODEL_FILE.bundle beside the model is used when --bundle is not "
                        "given); its log line says what went where")
    p.add_argument("--threads", type=int, default=0, help="CPU threads per actor (0: its cores)")
    p.add_argument("--ctx", type=int, default=0,
                   help="positions a sequence may reach (0: the model's context)")
    p.add_argument("--max-batch", type=int, default=64,
                   help="sequences running together (as the KV cache's blocks allow)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests waiting to be admitted before 429 answers")
    p.add_argument("--kv-cache-gb", type=gib, default=0.0,
                   help="memory of the paged KV cache (0: auto, from the host's free memory)")
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="compute every prompt whole (no reuse of cached prefixes)")
    p.add_argument("--prefill-chunk", type=int, default=512,
                   help="prompt tokens a step at most, beside the running streams (0: a "
                        "prompt in one step)")
    p.add_argument("--prefill-pace", type=float, default=3.0,
                   help="beside decoding streams, a step's prompt chunk is cut so that the step "
                        "takes about this many times a decode step (0: whole chunks)")
    p.add_argument("--request-timeout", type=seconds, default=REQUEST_TIMEOUT_S,
                   help="seconds a request may take, streaming included, before the proxy "
                        "cancels it (0: no limit)")
    p.add_argument("--drain-timeout", type=seconds, default=DRAIN_S, metavar="SECONDS",
                   help="at a stop (Ctrl-C, SIGTERM), the time the responses in flight have to "
                        "finish, new requests refused meanwhile; those still running then end "
                        f"with an error that says so (default {DRAIN_S:.0f})")
    p.add_argument("--stream-interval-ms", type=float, default=None, metavar="MS",
                   help="a stream's tokens go to its client at most once per MS milliseconds, "
                        "those generated meanwhile in one chunk (default 50; 0: each token as "
                        "it comes, at more CPU in Serve's hops a token); the first token and "
                        "the last are never held")
    p.add_argument("--log-requests", action="store_true", help="Serve's access log")
    p.add_argument("--demo", action="store_true",
                   help="once ready, send one chat request through the HTTP API and print it")
    p.set_defaults(run=_run)


def _run(args) -> int:
    if args.config:
        if args.model or args.bundle:
            raise ConfigError("give the models either in --config or with --model, not both")
        d = _read_yaml(args.config)
    else:
        model = args.model or DEFAULT_MODEL
        if not os.environ.get("RAY_ADDRESS"):  # (a cluster's node may hold a file this lacks)
            resolve_model(model)  # the one model missing: said now, not once Ray has started
        looks_like_a_path = Path(model).exists() or "/" in model or Path(model).suffix == ".gguf"
        name = args.name or (Path(model).stem if looks_like_a_path else model)
        d = {"models": [dict(name=name, model=model, bundle=args.bundle,
                             # (none named: the entry's rules, `settings.ModelSpec.base` and
                             # `settings.share_cores`)
                             **({"device": args.device} if args.device else {}),
                             **({"cold_executors": args.cold_executors}
                                if args.cold_executors is not None else {}),
                             dtype=args.dtype, cpu_isa=args.cpu_isa,
                             input_sparsity=args.input_sparsity, cpu_threads=args.threads, max_seq_len=args.ctx,
                             max_batch=args.max_batch, max_queue=args.max_queue,
                             kv_cache_gb=args.kv_cache_gb, prefix_cache=args.prefix_cache,
                             prefill_chunk=args.prefill_chunk,
                             prefill_pace=args.prefill_pace,
                             vram_budget_gb=args.vram_budget)]}
    if args.api_key:
        d["api_key"] = args.api_key
    if args.stream_interval_ms is not None:  # (over a models file's own)
        d["stream_interval_ms"] = args.stream_interval_ms
    settings = ServeSettings.from_dict(d)
    for m in settings.models:
        if m.chosen:
            say(f"{m.name}: {m.chosen}")
    # said here once: the replicas (whose logs Ray forwards to this console) need not say it again
    settings = replace(settings, models=tuple(replace(m, chosen="") for m in settings.models))
    return serve_forever(settings, Frontend(args.host, args.port, args.grpc_port,
                                            args.log_requests, args.request_timeout,
                                            args.drain_timeout),
                         demo=args.demo)


def _read_yaml(path: str) -> dict:
    import yaml

    try:
        return yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read serving config {path}: {e}") from e
