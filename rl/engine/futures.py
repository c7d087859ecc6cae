"""The engine's ordered request queue and the futures its requests return.

`RequestQueue` is what `ForwardBackwardPipeline` builds on (and `AsyncTrainingClient` through it):

* Requests run in submission order, so a request always sees the effects of the ones submitted
  before it (an `optim_step` the gradients of the `forward_backward` calls queued ahead of it): by
  default in the calling thread (the future is already done when it is returned), or with
  `asynchronous=True` on ONE worker thread. Inline is the default because a second thread that runs
  torch ops gets its own OpenMP pool: measured on 2 CPU cores, generation in the main thread after
  one backward on a worker thread ran 2.3x slower (0.10 s -> 0.23 s per rollout), the two pools
  fighting for the cores. On a GPU the kernels are asynchronous anyway; `AsyncTrainingClient` uses
  the worker thread.
* A request that fails raises from its own future's `.result()`, and later requests still run; one
  whose future nobody reads is not lost: `shutdown()` logs every such failure (with its traceback)
  and raises the first (the reference docs never read the client's `optim_future`). A queue dropped
  without `shutdown()` still logs them, at garbage collection or interpreter exit.

`RequestFuture` records whether its outcome was read; `SampleFuture` also reads like the dict it
resolves to (the reference's `pipeline.sample(...)["tokens"]`).
"""

from __future__ import annotations

import logging
import threading
import traceback
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger(__name__)


class _InlineExecutor:
    """Runs each request at once in the caller's thread (the request stores its outcome, or its
    exception, in its own future, as on the worker thread)."""

    def submit(self, fn: Callable) -> None:
        fn()

    def shutdown(self, wait: bool = True) -> None:  # noqa: ARG002
        pass


@dataclass
class _Failure:
    """A failed request, as text (no frames, so it holds neither tensors nor the pipeline)."""

    request: str
    error: str  # "ValueError: message"
    traceback: str
    read: bool = False


class RequestFuture(Future):
    """The future of one engine request; it records whether its outcome was read (`result()` or
    `exception()` after it finished), so a failure nobody read is reported at `shutdown()`."""

    request = "request"
    failure: _Failure | None = None

    def _mark_read(self) -> None:
        if self.failure is not None and self.done():
            self.failure.read = True

    def result(self, timeout=None):
        try:
            return super().result(timeout)
        finally:
            self._mark_read()

    def exception(self, timeout=None):
        try:
            return super().exception(timeout)
        finally:
            self._mark_read()


class SampleFuture(RequestFuture):
    """A future that also reads like the dict it resolves to (`samples["tokens"]` blocks until
    done), so both the reference's `pipeline.sample(...)["tokens"]` and `.result()` work."""

    def __getitem__(self, key):
        return self.result()[key]

    def keys(self):
        return self.result().keys()

    def get(self, key, default=None):
        return self.result().get(key, default)


def _log_unread(failed: list) -> list:
    """Log (ERROR, with the traceback) each failed request whose future was never read, mark them
    read, empty `failed` and return them. Also the queue's finalizer (garbage collection or
    interpreter exit without `shutdown()`), so it takes the list, not the queue."""
    unread = [f for f in failed if not f.read]
    for f in unread:
        f.read = True
        log.error("engine request %s failed and its future was never read: %s\n%s", f.request, f.error,
                  f.traceback.rstrip())
    failed.clear()
    return unread


class RequestQueue:
    """Requests that run one at a time in submission order, each returning a `RequestFuture`.

    Args:
        asynchronous: run requests on one background worker thread instead of inline in the
            calling thread (see the module docstring for why inline is the default).
    """

    def __init__(self, asynchronous: bool = False):
        self._executor = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="fb-worker") if asynchronous
                          else _InlineExecutor())
        # failed requests (as text: a traceback would keep the queue alive), until shutdown() reports them
        self._failed: list[_Failure] = []
        self._failed_lock = threading.Lock()  # the worker appends while the caller prunes
        # at garbage collection or interpreter exit without shutdown(): still log what nobody read
        weakref.finalize(self, _log_unread, self._failed)

    def submit(self, fn: Callable, *args, **kwargs) -> RequestFuture:
        """Run `fn` after every request submitted before it; its future (see `RequestFuture`)."""
        return self._submit(RequestFuture(), fn, *args, **kwargs)

    def _submit(self, future: RequestFuture, fn: Callable, *args, **kwargs) -> RequestFuture:
        """`submit`, delivering the outcome through `future` (a `RequestFuture` or a subclass)."""
        future.request = getattr(fn, "__name__", "request").lstrip("_")
        with self._failed_lock:  # drop the ones already read
            self._failed[:] = [f for f in self._failed if not f.read]

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                result = fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - delivered through the future
                future.failure = _Failure(future.request, f"{type(e).__name__}: {e}",
                                          "".join(traceback.format_exception(e)))
                with self._failed_lock:
                    self._failed.append(future.failure)
                future.set_exception(e)
            else:
                future.set_result(result)

        self._executor.submit(run)
        return future

    def shutdown(self, wait: bool = True) -> None:
        """Finish the queued requests; then log every failed request whose future was never read
        (with its traceback) and raise a RuntimeError naming the first, so no error vanishes silently."""
        self._executor.shutdown(wait=wait)
        if wait:
            self._raise_unread()

    def shutdown_logging_unread(self) -> None:
        """Finish the queued requests and log (do not raise) the failures whose futures were never
        read: for shutting down while another exception is already on its way, not to mask it."""
        self._executor.shutdown(wait=True)
        _log_unread(self._failed)

    def _raise_unread(self) -> None:
        unread = _log_unread(self._failed)
        if unread:
            raise RuntimeError(f"{len(unread)} request(s) failed and their futures were never read (tracebacks "
                               f"logged); the first, {unread[0].request}: {unread[0].error}")
