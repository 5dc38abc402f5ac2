"""What DMTCP 4.2 needs to checkpoint programs that fork, and what to say when it cannot.

Measured (gdb on a stuck training script): a torch script that runs a subprocess hangs in
``fork()`` for good under DMTCP, because NumPy's OpenBLAS joins its threads in a pre-fork
handler while one of them waits, in DMTCP's thread-start wrapper, for the lock the forking
thread holds. With one OpenBLAS thread the fork returns and the image restores. A program
with DataLoader worker processes forks fine then, but its images do not complete while a
worker is alive (one taken between epochs, with none, does).
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["STALL_S", "StuckImages", "fork_safe_env", "stuck_message"]

#: An image with no byte written for this long after the request will not complete: DMTCP
#: suspends the threads and starts writing within a second or two (a torch process's 650 MB
#: take ~1 s here), and writes on without pause.
STALL_S = 15.0
#: A stop whose image had not begun this long after the request, when the command was killed
#: at the deadline: as telling as a stall, once two cycles in a row end so.
UNSTARTED_S = 3.0


def fork_safe_env(environ: Mapping[str, str]) -> dict[str, str]:
    """What the command's environment needs so that it can fork under DMTCP 4.2.

    NumPy's OpenBLAS joins its worker threads before every fork (a pthread_atfork handler);
    under DMTCP a thread started meanwhile waits for the lock the forking thread holds, so the
    fork never returns (gdb: blas_thread_shutdown_ in pthread_join, the thread in DMTCP's
    thread_start). One OpenBLAS thread has none to join. torch's own threads (OpenMP, MKL)
    are not affected, so the training computes as before. A value the user set is kept.
    """
    if "OPENBLAS_NUM_THREADS" in environ:
        return {}
    return {"OPENBLAS_NUM_THREADS": "1"}


def stuck_message(what: str, processes: int) -> str:
    """Why DMTCP cannot checkpoint this command, and the ways out, in one line."""
    if processes > 1:
        why = (f"the command runs {processes} processes (DataLoader workers, or a child it "
               "started?), and DMTCP 4.2 does not complete images of PyTorch programs with "
               "worker processes. Ways out: DataLoader(num_workers=0), or --engine hooks "
               "(procckpt.Checkpointer in the script)")
    else:
        why = ("the command is likely stuck in a fork under threads of a library other than "
               "NumPy's OpenBLAS (procckpt sets OPENBLAS_NUM_THREADS=1 unless it is set). Ways "
               "out: OMP_NUM_THREADS=1, or --engine hooks (procckpt.Checkpointer in the script)")
    return f"DMTCP could not checkpoint the command ({what}): {why}"


class StuckImages:
    """Whether this command's images can complete, from how its checkpoints went."""

    def __init__(self) -> None:
        #: Why no image will complete (a failure that repeats), once seen; else None.
        self.message: str | None = None
        self._unstarted = 0  # cycles in a row killed before their stop image began
        self._stalls = 0  # images in a row that stopped growing

    def stalled(self, waited: float, processes: int) -> bool:
        """An image stopped growing for :data:`STALL_S` before it was complete. Twice in a
        row, no image will: once may be a request that met a short-lived child process
        (a ``subprocess.run`` under way), and the next cycle, restarted from the last image,
        takes its images as before. Returns whether it repeats."""
        self._stalls += 1
        if self._stalls < 2:
            return False
        self.message = stuck_message(
            f"twice in a row no byte of its image written for {STALL_S:.0f}s, the last "
            f"{waited:.0f}s after the request", processes)
        return True

    def completed(self) -> None:
        """An image was complete: the stalls before it were passing ones."""
        self._stalls = 0

    def stop_ended(self, confirmed: bool, wrote: bool, sent_at: float | None, over_at: float,
                   processes: int) -> None:
        """A cycle with a stop request ended. Killed at its deadline before the stop's image
        began is a stuck image seen too briefly to tell; two such cycles in a row are."""
        if confirmed:
            self._unstarted = 0
            return
        if wrote or sent_at is None or over_at - sent_at < UNSTARTED_S:
            return
        self._unstarted += 1
        if self._unstarted >= 2 and self.message is None:
            self.message = stuck_message(
                f"{self._unstarted} cycles in a row, no byte of the image written in the "
                f"{over_at - sent_at:.0f}s from the request to the deadline", processes)
