"""Which tensors a snapshot copies off a device, and the streams and events it copies them with.

The arena and the step fence copy GPU state on a side stream and order the training stream
after it with events (arena.py, fence.py). They reach CUDA only through :func:`device_ops`:

- :class:`CudaOps`, the real thing: CUDA tensors, CUDA streams and events, page-locking with
  ``cudaHostRegister``.
- :class:`CpuTwin`, for tests on machines without a GPU (``PROCCKPT_DEVICE_TWIN=1``): CPU
  tensors count as device state and take the same path. Its side stream is a thread that runs
  the queued copies in order, an event is set once the copies queued before it ran, and a wait
  for an event blocks the training thread (the "training stream" of a CPU). So the branches
  that otherwise run only with CUDA state (what is copied late, the fence's hook on each
  optimizer, the wait before ``step()``, the page-locked arena's layout) run in CI, and an
  ordering mistake shows up as a wrong snapshot, as it would on a GPU.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["CudaOps", "CpuTwin", "device_ops", "ENV_DEVICE_TWIN"]

logger = logging.getLogger(__name__)

#: Test seam: "1" makes CPU tensors take the GPU path, with a thread as the side stream.
ENV_DEVICE_TWIN = "PROCCKPT_DEVICE_TWIN"


class CudaOps:
    """CUDA's streams, events and page-locking."""

    twin = False

    @staticmethod
    def holds(t: torch.Tensor) -> bool:
        """Whether ``t`` is device state (copied on a side stream into page-locked memory)."""
        return t.is_cuda

    @staticmethod
    def current_stream(device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    @staticmethod
    def new_stream(device: torch.device) -> Any:
        return torch.cuda.Stream(device)

    @staticmethod
    def copy(stream: Any, copy: Callable[[bool], None]) -> None:
        """Queue ``copy(non_blocking)`` on ``stream``."""
        with torch.cuda.stream(stream):
            copy(True)

    @staticmethod
    def record(stream: Any) -> Any:
        """An event that completes once the work queued on ``stream`` so far has run."""
        event = torch.cuda.Event()
        event.record(stream)
        return event

    @staticmethod
    def page_lock(flat: torch.Tensor) -> bool:
        try:
            cudart = torch.cuda.cudart()
            rc = cudart.cudaHostRegister(flat.data_ptr(), flat.numel(), 0)
        except Exception as e:  # no CUDA runtime binding: the caller falls back
            logger.debug("cudaHostRegister unavailable: %s", e)
            return False
        return int(rc) == 0

    @staticmethod
    def unlock(flat: torch.Tensor) -> None:
        with contextlib.suppress(Exception):
            torch.cuda.cudart().cudaHostUnregister(flat.data_ptr())


class _TwinEvent:
    """A CUDA event's twin: set once the copies queued before it on its stream ran."""

    def __init__(self) -> None:
        self._done = threading.Event()

    def synchronize(self) -> None:
        self._done.wait()


def _serve(work: queue.SimpleQueue[Callable[[], None] | None]) -> None:
    """A twin stream's thread: what is queued, in order, until the stream is collected."""
    while True:
        job = work.get()
        if job is None:
            return
        try:
            job()
        except BaseException:  # noqa: BLE001 - a failed copy must not stop later events
            logger.exception("a copy on the twin side stream failed")
        del job  # (what it refers to may hold the stream)


class _TwinStream:
    """A side stream's twin: one thread that runs what is queued on it, in order."""

    def __init__(self, delay: float) -> None:
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._delay = delay
        threading.Thread(target=_serve, args=(self._queue,), name="procckpt-twin-stream",
                         daemon=True).start()
        # The thread holds the queue, not the stream: once the stream is gone, so is it.
        weakref.finalize(self, self._queue.put, None)

    def put(self, work: Callable[[], None], *, copy: bool = False) -> None:
        delay = self._delay if copy else 0.0

        def run() -> None:
            if delay:
                time.sleep(delay)
            work()

        self._queue.put(run)

    def wait_stream(self, other: Any) -> None:
        """Work queued on the training "stream" of a CPU has run already."""


class _TwinTrainingStream:
    """The training thread itself: waiting for an event blocks it."""

    def wait_event(self, event: _TwinEvent) -> None:
        event.synchronize()


class CpuTwin:
    """CUDA's twin on the CPU for tests: see the module's docstring.

    Args:
        delay: seconds each queued copy waits before it runs (tests widen the window in
            which a training step that did not wait for the copy would change its source).
    """

    twin = True

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self._training = _TwinTrainingStream()

    @staticmethod
    def holds(t: torch.Tensor) -> bool:
        return t.device.type == "cpu"

    def current_stream(self, device: torch.device) -> Any:
        return self._training

    def new_stream(self, device: torch.device) -> Any:
        return _TwinStream(self.delay)

    @staticmethod
    def copy(stream: _TwinStream, copy: Callable[[bool], None]) -> None:
        stream.put(lambda: copy(False), copy=True)

    @staticmethod
    def record(stream: _TwinStream) -> _TwinEvent:
        event = _TwinEvent()
        stream.put(event._done.set)
        return event

    @staticmethod
    def page_lock(flat: torch.Tensor) -> bool:
        return True  # host memory is all the twin's "device" needs

    @staticmethod
    def unlock(flat: torch.Tensor) -> None:
        pass


_CUDA = CudaOps()
_twins: dict[str, CpuTwin] = {}


def device_ops() -> CudaOps | CpuTwin:
    """CUDA's operations, or the CPU twin's where ``PROCCKPT_DEVICE_TWIN=1`` (tests only;
    ``PROCCKPT_DEVICE_TWIN_DELAY`` seconds before each of its copies)."""
    if os.environ.get(ENV_DEVICE_TWIN, "") != "1":
        return _CUDA
    delay = os.environ.get("PROCCKPT_DEVICE_TWIN_DELAY", "0")
    twin = _twins.get(delay)
    if twin is None:
        twin = _twins[delay] = CpuTwin(float(delay))
    return twin
