"""The CRIU engine: whole-tree images of an unmodified command, DataLoader workers included."""

from .engine import CriuEngine
from .tools import CriuError, CriuProblem, CriuTools, criu_problem, criu_usable, find_criu

__all__ = ["CriuEngine", "CriuError", "CriuProblem", "CriuTools", "criu_problem", "criu_usable",
           "find_criu"]
