"""This rank's Checkpointer as the group coordinator sees it: the one place where the
coordinator's needs (``distributed.GroupMember``) meet the Checkpointer's internals."""

from __future__ import annotations

from typing import Any

from ...store import CheckpointInfo
from .payload import PAYLOAD, read_payload

__all__ = ["CheckpointerAsMember"]


class CheckpointerAsMember:
    """This rank's Checkpointer as the group coordinator sees it (``distributed.GroupMember``):
    the one place where the coordinator's needs meet the Checkpointer's internals."""

    payload_name = PAYLOAD

    def __init__(self, checkpointer: Any) -> None:
        self._ck = checkpointer
        self.store = checkpointer.store

    @property
    def step(self) -> int:
        return self._ck.step

    @property
    def statefuls(self) -> dict[str, Any]:
        return self._ck._statefuls

    @property
    def frozen(self) -> Any:
        """What writes the frozen parameters once (save/frozen.py); None on ranks but 0."""
        return self._ck._saves.frozen

    def checkpoint_meta(self, reason: str) -> dict[str, Any]:
        return self._ck._meta(reason)

    def replicated_payload(self, exclude: set[str]) -> dict[str, Any]:
        return self._ck._payload(exclude=exclude)

    def rank_payload(self) -> dict[str, Any]:
        return self._ck._progress.saved_state()

    def record_save(self, info: CheckpointInfo, reason: str, seconds: float) -> None:
        ck = self._ck
        ck._saves.taken(info, reason, ck._progress.position, ck.restart, seconds)

    def record_background(self, info: CheckpointInfo, request: Any, reason: str,
                          position: tuple[int, int, int], seconds: float, stall: float) -> None:
        ck = self._ck
        ck._saves.durable(info, request, reason, position, ck.restart, seconds, stall)

    def record_failed(self, request: Any, position: tuple[int, int, int], reason: str,
                      error: str) -> None:
        self._ck._saves.failed(request, position, reason, error)

    def load_newest(self) -> tuple[CheckpointInfo, dict[str, Any]] | None:
        return self._ck._load_latest()

    def read_payload(self, info: CheckpointInfo) -> dict[str, Any]:
        return read_payload(info)
