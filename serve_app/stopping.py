"""A server's stop, as its ingress replicas see it.

`powerinfer serve`, told to stop, announces it in Ray's key-value store (`announce`) with the
time the responses in flight have to finish (`--drain-timeout`). Every ingress replica reads the
announcement (`StopWatch`, a thread that looks every POLL_S seconds) and from then on refuses
new requests (503, gRPC UNAVAILABLE, health NOT_SERVING: a load balancer sends them elsewhere)
and ends each response still running at the announced time with an error saying so (an SSE
error event and [DONE], a 503, a gRPC status) rather than a cut connection. Each replica reports
how many responses it still has (`left`); the server deletes the application once none has any,
so a stop waits for the responses in flight and no longer than they take.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from typing import Callable

log = logging.getLogger("ray.serve")
NAMESPACE = "powerinfer"
POLL_S = 0.5


def _key(app: str) -> bytes:
    return f"stop:{app}".encode()


def _report(app: str, replica: str = "") -> bytes:
    return f"stop:{app}:left:{replica}".encode()


def announce(app: str, grace_s: float):
    """The stop of `app`: its responses in flight have `grace_s` seconds (wall clock) to end."""
    from ray.experimental import internal_kv as kv

    kv._internal_kv_put(_key(app), json.dumps({"until": time.time() + grace_s}).encode(),
                        overwrite=True, namespace=NAMESPACE)


def clear(app: str):
    """Forget a stop of `app` and its replicas' reports (a server that starts after one that
    stopped, or died stopping, on the same cluster)."""
    from ray.experimental import internal_kv as kv

    kv._internal_kv_del(_key(app), namespace=NAMESPACE)
    kv._internal_kv_del(_report(app), del_by_prefix=True, namespace=NAMESPACE)


def left(app: str) -> dict[str, int]:
    """Each ingress replica's responses still running, as it last reported them."""
    from ray.experimental import internal_kv as kv

    out = {}
    for k in kv._internal_kv_list(_report(app), namespace=NAMESPACE):
        v = kv._internal_kv_get(k, namespace=NAMESPACE)
        if v is not None:
            out[k.decode().rpartition(":")[2]] = int(v)
    return out


class StopWatch:
    """An ingress replica's look-out for its server's stop: a daemon thread that reads the
    announcement every POLL_S seconds, calls `on_stop(until)` (wall-clock seconds) when it comes
    (and again if a later one brings the time forward), and from then reports `running()` every
    POLL_S seconds. `until` is None while the server serves."""

    def __init__(self, app: str, replica: str, on_stop: Callable[[float], None],
                 running: Callable[[], int]):
        self.app, self.replica = app, replica
        self.on_stop, self.running = on_stop, running
        self.until: float | None = None
        threading.Thread(target=self._run, name="stop-watch", daemon=True).start()

    def _run(self):
        from ray.experimental import internal_kv as kv

        while True:
            time.sleep(POLL_S)
            try:
                got = kv._internal_kv_get(_key(self.app), namespace=NAMESPACE)
                if got is not None:  # (a later, earlier time: a second Ctrl-C ends them now)
                    until = float(json.loads(got)["until"])
                    if self.until is None or until < self.until:
                        self.until = until
                        self.on_stop(until)
                if self.until is not None:
                    kv._internal_kv_put(_report(self.app, self.replica),
                                        str(self.running()).encode(), overwrite=True,
                                        namespace=NAMESPACE)
            except Exception as e:  # noqa: BLE001 - the GCS away a moment; looked at again
                log.debug("stop watch: %s", e)
