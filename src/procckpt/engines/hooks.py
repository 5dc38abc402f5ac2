"""The hooks engine, launcher side: requests through ``control/``, acks from the Checkpointer."""

from __future__ import annotations

from ..control import ENV_TOKEN, ControlChannel
from ..store import CheckpointStore
from . import Confirmation

__all__ = ["HooksEngine"]


class HooksEngine:
    name = "hooks"

    def __init__(self, store: CheckpointStore) -> None:
        self.store = store
        self._channel: ControlChannel | None = None
        self._seq = 0

    def start_cycle(self, argv: list[str], token: str) -> tuple[list[str], dict[str, str]]:
        self._channel = ControlChannel(self.store.control_dir, token)
        self._channel.clear()
        return list(argv), {ENV_TOKEN: token}

    def request(self, action: str, reason: str) -> int:
        assert self._channel is not None
        self._seq += 1
        self._channel.send(self._seq, action, reason)
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

    def end_cycle(self) -> Confirmation | None:
        assert self._channel is not None
        ack = self._channel.read_ack()
        if ack is None or not ack.stopping or ack.checkpoint is None:
            return None
        return Confirmation(ack.checkpoint, ack.step, ack.stopping, ack.seq, ack.error)
