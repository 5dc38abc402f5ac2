"""The hooks engine, launcher side: requests through ``control/``, acks from the Checkpointer."""

from __future__ import annotations

from typing import Any

from ...protocol.control import ENV_STOP_EXIT, ENV_TOKEN, ControlChannel, Heartbeat
from ...protocol.exits import ENV_EXITS, ExitNotes
from ...store import CheckpointStore
from ...store.files import lasting_write_error
from . import Confirmation, Engine, RequestUndelivered

__all__ = ["HooksEngine"]


class HooksEngine(Engine):
    name = "hooks"
    reports_progress = True

    def __init__(self, store: CheckpointStore) -> None:
        self.store = store
        self._channel: ControlChannel | None = None
        self._seq = 0
        #: The cycle's folder for the notes of ranks that procckpt ended, and what it held.
        self._exits: ExitNotes | None = None
        self._noted: list[dict[str, Any]] | None = []

    def start_cycle(self, argv: list[str], token: str) -> tuple[list[str], dict[str, str]]:
        self._channel = ControlChannel(self.store.control_dir, token)
        self._channel.clear()
        try:
            self._exits, self._noted = ExitNotes(), []
        except OSError:  # no folder anywhere: the exit code alone tells (as without notes)
            self._exits, self._noted = None, None
        # A planned stop exits 0: the ack tells this launcher it was one, and torchrun would
        # report any other code as a failure of every rank.
        env = {ENV_TOKEN: token, ENV_STOP_EXIT: "0"}
        if self._exits is not None:
            env[ENV_EXITS] = str(self._exits.dir)
        return list(argv), env

    def procckpt_exits(self) -> list[dict[str, Any]] | None:
        return self._noted

    def request(self, action: str, reason: str) -> int:
        assert self._channel is not None
        self._seq += 1
        try:
            self._channel.send(self._seq, action, reason)
        except OSError as e:
            raise RequestUndelivered(self._seq, f"could not write the checkpoint request into "
                                     f"{self._channel.dir} ({e.strerror or e})",
                                     lasting=lasting_write_error(e, self._channel.dir)
                                     is not None) from e
        return self._seq

    def confirmation(self, seq: int) -> Confirmation | None:
        assert self._channel is not None
        ack = self._channel.read_ack()
        if ack is None or not (ack.seq >= seq or ack.stopping):
            return None
        return Confirmation(ack.checkpoint, ack.step, ack.stopping, ack.seq, ack.error)

    def connected(self) -> bool:
        assert self._channel is not None
        return self._channel.hello() is not None

    def progress(self) -> Heartbeat | None:
        """The training's newest heartbeat in this cycle (for hang detection)."""
        assert self._channel is not None
        return self._channel.heartbeat()

    def failures(self) -> list[dict[str, Any]]:
        """What the ranks that an exception ended in this cycle said (rank, host, error)."""
        assert self._channel is not None
        return self._channel.failures()

    def end_cycle(self) -> Confirmation | None:
        assert self._channel is not None
        if self._exits is not None:  # the command has exited: its notes are all there
            self._noted = self._exits.read()
            self._exits.remove()
            self._exits = None
        ack = self._channel.read_ack()
        if ack is None or not ack.stopping or ack.checkpoint is None:
            return None
        return Confirmation(ack.checkpoint, ack.step, ack.stopping, ack.seq, ack.error)
