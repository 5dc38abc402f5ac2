"""The CRIU engine: whole-tree images of an unmodified command, DataLoader workers included."""

from .engine import CriuEngine
from .tools import CriuError, CriuTools, criu_problem, find_criu

__all__ = ["CriuEngine", "CriuError", "CriuTools", "criu_problem", "find_criu"]
