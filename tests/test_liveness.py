"""The training side of hang detection (training/link/liveness.py): a real sampler thread watching
a real thread that computes, blocks on a lock, or sleeps; the heartbeat read back as the
launcher reads it."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from procckpt.protocol.control import ControlChannel
from procckpt.training.link.liveness import Liveness


def watch(tmp_path: Path, body, seconds: float = 2.0,
          until_moves: int | None = None) -> tuple[int, int]:
    """Run ``body(stop)`` in a thread under a Liveness for ``seconds`` (with ``until_moves``:
    until it counted that many moves and a heartbeat said some, or ``seconds`` passed); the
    moves counted while it ran, and the moves the launcher read from the last heartbeat."""
    stop = threading.Event()
    thread = threading.Thread(target=body, args=(stop,), daemon=True)
    thread.start()
    liveness = Liveness(ControlChannel(tmp_path, "tok"), thread)
    time.sleep(0.3)  # the thread has reached what it does for the rest of the time
    liveness.start()
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and (
                until_moves is None or liveness.moves < until_moves or said(tmp_path) == 0):
            time.sleep(0.1)
        moves = liveness.moves
    finally:
        liveness.close()
        stop.set()
    return moves, said(tmp_path)


def said(tmp_path: Path) -> int:
    """The moves of the last heartbeat, as the launcher reads them."""
    beat = ControlChannel(tmp_path, "tok").heartbeat()
    return beat.moves if beat is not None else 0


def evaluating(stop: threading.Event) -> None:
    """Python code between safe points: an evaluation loop."""
    total = 0
    while not stop.is_set():
        for i in range(1000):
            total += sum(range(i % 50))


def test_a_thread_running_python_code_moves(tmp_path: Path):
    # Most samples move (five a second); on a loaded machine the sampler gets fewer turns (a
    # CI run under three parallel suites saw 5 of 10, a run of this suite 1 of 10 in 2 s), so
    # the test waits for two moves rather than for a time: any movement at all is what tells
    # it from the blocked threads below (exactly 0).
    moves, beat = watch(tmp_path, evaluating, seconds=30, until_moves=2)
    assert moves >= 2 and beat > 0, (moves, beat)


def test_a_loop_that_waits_at_the_same_line_each_round_moves(tmp_path: Path):
    # Nearly every sample finds it in the same call (a short sleep, as a read or a device
    # sync would be), but it wakes again and again.
    def waiting_each_round(stop: threading.Event) -> None:
        while not stop.is_set():
            time.sleep(0.002)

    moves, beat = watch(tmp_path, waiting_each_round, seconds=30, until_moves=2)
    assert moves >= 2 and beat > 0, (moves, beat)


def test_a_wait_loop_that_wakes_to_look_again_does_not_move(tmp_path: Path):
    # The DataLoader's main thread waiting for a batch from a stuck worker: queue.get with a
    # timeout, a look at the workers, again (every 5 s there; every 0.3 s here). Its stack
    # and its context switches change at each wake-up, but it does no work.
    import queue

    def waiting_for_a_batch(stop: threading.Event) -> None:
        batches: queue.Queue[int] = queue.Queue()
        while not stop.is_set():
            try:
                batches.get(timeout=0.3)
            except queue.Empty:
                continue

    def polling(stop: threading.Event) -> None:
        while not stop.is_set():  # while not ready: sleep(0.1)
            time.sleep(0.1)

    assert watch(tmp_path, waiting_for_a_batch, seconds=3.0) == (0, 0)
    assert watch(tmp_path, polling, seconds=3.0) == (0, 0)


def test_a_wait_loop_whose_wake_ups_are_slow_does_not_move(tmp_path: Path):
    # The same wait on a slow or loaded node: each wake-up costs the thread milliseconds of
    # processor time (above the per-sample threshold), once a second. Each is one active
    # sample, never two in a row (the old rule counted every one: the hang went unseen).
    import queue

    def slow_wake_ups(stop: threading.Event) -> None:
        batches: queue.Queue[int] = queue.Queue()
        while not stop.is_set():
            try:
                batches.get(timeout=1.0)
            except queue.Empty:
                end = time.thread_time() + 0.003  # the look at the workers, slowly
                while time.thread_time() < end:
                    pass

    assert watch(tmp_path, slow_wake_ups, seconds=4.0) == (0, 0)


def test_a_thread_blocked_on_a_lock_or_sleeping_does_not_move(tmp_path: Path):
    lock = threading.Lock()
    lock.acquire()

    def blocked(stop: threading.Event) -> None:
        with lock:
            pass

    assert watch(tmp_path, blocked) == (0, 0)
    lock.release()

    def sleeping(stop: threading.Event) -> None:
        time.sleep(3600)

    assert watch(tmp_path, sleeping) == (0, 0)


def test_working_counts_a_long_native_call_as_progress(tmp_path: Path):
    liveness_box: list[Liveness] = []

    def in_one_call(stop: threading.Event) -> None:
        while not liveness_box:
            time.sleep(0.01)
        with liveness_box[0].working():
            stop.wait()  # one call, as a kernel or a blocking library call would be

    stop = threading.Event()
    thread = threading.Thread(target=in_one_call, args=(stop,), daemon=True)
    thread.start()
    liveness = Liveness(ControlChannel(tmp_path, "tok"), thread)
    liveness_box.append(liveness)
    liveness.start()
    try:
        time.sleep(1.5)
        assert liveness.moves >= 4
    finally:
        liveness.close()
        stop.set()


def test_the_heartbeat_says_the_step_and_the_longest_gap_and_stops_when_closed(
        tmp_path: Path):
    liveness = Liveness(ControlChannel(tmp_path, "tok"), threading.current_thread())
    liveness.at_safe_point(40, now=100.0)  # the first: no gap before it
    liveness.left_safe_point()
    liveness.at_safe_point(41, now=time.monotonic() + 7.5)  # a 7.5 s validation pass
    liveness.left_safe_point()
    liveness.start()
    time.sleep(0.5)
    liveness.close()
    beat = ControlChannel(tmp_path, "tok").heartbeat()
    assert beat is not None and beat.step == 41
    assert 7.5 <= beat.gap < 8.0
    heartbeat = tmp_path / "heartbeat.json"
    before = heartbeat.stat().st_mtime_ns
    liveness.step = 42
    time.sleep(1.5)
    assert heartbeat.stat().st_mtime_ns == before  # no sampler left after close


def test_a_rank_ended_by_an_exception_tells_the_launcher(tmp_path: Path):
    # The launcher of a group looks at the job's nodes when a rank failed and the command
    # still runs (launcher/watch.py): the rank says so before Python prints its traceback.
    script = ("import sys; from pathlib import Path\n"
              "from procckpt.training.link.context import open_control\n"
              "open_control(Path(sys.argv[1]), 'tok', 3)\n"
              "raise RuntimeError('Connection closed by peer [10.0.0.2]:9911\\nGLHF')\n")
    res = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 1 and "Traceback" in res.stderr and "GLHF" in res.stderr
    [failure] = ControlChannel(tmp_path, "tok").failures()
    assert failure["rank"] == 3 and failure["host"] == socket.gethostname()
    assert failure["error"] == "RuntimeError: Connection closed by peer [10.0.0.2]:9911"
    assert ControlChannel(tmp_path, "another cycle").failures() == []
    # Ctrl-C is no failure of the rank; a run outside procckpt run reports nothing.
    ControlChannel(tmp_path, "tok").clear()
    for token, error in (("tok", "KeyboardInterrupt"), ("", "RuntimeError")):
        code = script.replace("'tok'", repr(token)).replace(
            "RuntimeError('Connection closed by peer [10.0.0.2]:9911\\nGLHF')", error)
        res = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                             text=True, timeout=60)
        assert res.returncode != 0 and error in res.stderr
        assert ControlChannel(tmp_path, "tok").failures() == [] and not list(tmp_path.iterdir())
