"""Settle the dispatch of torch's CPU vector math before training threads race on it.

torch's CPU build computes float unary ops of contiguous tensors (``sqrt``, ``exp``, ``tanh``,
``erf``...) with MKL's vector math (VML), a chunk of 2,048 elements per intra-op thread. MKL
picks each function's kernel on that function's first call; when several threads make that
first call at once, one of them can run a low-accuracy kernel over its whole chunk (MKL
2024.2, which torch 2.13's wheels carry; pytorch/pytorch#188792). Adam's first step takes a
``sqrt`` over every parameter: a process whose first step drew the wrong kernel trains on
other weights, so a resumed run is not bit-identical to the one it continues, and
``procckpt check`` calls a deterministic script nondeterministic.

One call of each function on one element, in one thread, settles its kernel for the process;
later calls are unchanged, bit for bit. It costs a few milliseconds, once (2.4 ms here, most of
it the ops' own first dispatch), and draws from no random stream.
"""

from __future__ import annotations

import logging
import threading

import torch

__all__ = ["settle_vector_math"]

logger = logging.getLogger(__name__)

#: The unary ops ATen hands to VML (aten/src/ATen/cpu/vml.h), each settled for both
#: precisions MKL keeps apart (``vmsSqrt``/``vmdSqrt``).
_OPS = ("abs", "acos", "asin", "atan", "cos", "cosh", "erf", "erfc", "erfinv", "exp", "expm1",
        "lgamma", "log", "log10", "log1p", "log2", "sin", "sinh", "sqrt", "tan", "tanh", "trunc")
_DTYPES = (torch.float32, torch.float64)

_settled = False
_lock = threading.Lock()


def settle_vector_math() -> bool:
    """Call each of torch's VML ops once on one element, in this thread (once per process);
    True if it did now. Nothing to do where torch has no MKL (the SLEEF kernels pick no
    kernel at run time)."""
    global _settled
    with _lock:
        if _settled:
            return False
        _settled = True
        if not torch.backends.mkl.is_available():
            return False
        with torch.no_grad():
            for dtype in _DTYPES:
                one = torch.full((1,), 0.5, dtype=dtype)
                for name in _OPS:
                    try:
                        getattr(torch, name)(one)
                    except (RuntimeError, AttributeError) as e:  # an op this build lacks
                        logger.debug("no %s(%s) to settle: %s", name, dtype, e)
        return True
