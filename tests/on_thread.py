"""A role's implementation (an executor, the predictor) built and run on a thread of its own, as
`actors.roles._Role.compute` runs it in an actor (its threads' count is that thread's), for tests
that drive it over its channels without Ray."""
from __future__ import annotations

import threading


class OnThread:
    """build() on a new daemon thread, then its `run()` there until it returns (`result`); a
    build's error is raised here."""

    def __init__(self, build):
        self.impl, self.result, self.error = None, None, None
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._main, args=(build,), daemon=True)
        self.thread.start()
        assert self.ready.wait(300) and self.error is None, self.error

    def _main(self, build):
        try:
            self.impl = build()
        except Exception as e:  # noqa: BLE001 - the test's to raise
            self.error = e
        self.ready.set()
        if self.impl is not None:
            self.result = self.impl.run()
