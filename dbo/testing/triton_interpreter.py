"""Speed for Triton's CPU interpreter (``TRITON_INTERPRET=1``) where the tests run dbo's kernels.

The interpreter runs a reduction with a combine function it does not know one element at a
time in Python. ``tl.sort`` (the routing's counting sort) reduces with xor in every
compare-and-swap step, so a sort of 1024 keys took seconds and the interpreter test minutes.
:func:`fast_xor_reduce` gives the xor reduction the numpy path the interpreter already has for
sum, min and max; the answer is the same (xor is associative and commutative).
"""

from __future__ import annotations

import logging

__all__ = ["fast_xor_reduce"]

logger = logging.getLogger(__name__)


def fast_xor_reduce() -> bool:
    """Make the interpreter's xor reductions (``tl.xor_sum``, used by ``tl.sort``) one numpy
    call; returns whether it did (False where this Triton has no interpreter of that shape:
    it then runs as before, only slower). Call it in the process that runs the interpreter,
    before the first launch; calling it again changes nothing."""
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter

        ops = interpreter.ReduceOps
        xor = tl.standard._xor_combine
    except (ImportError, AttributeError) as exc:
        logger.info("Triton's interpreter keeps its own xor reduction: %s", exc)
        return False
    if getattr(ops.apply_impl, "dbo_fast_xor", False):
        return True
    slow = ops.apply_impl

    def apply_impl(self, input):
        if self.combine_fn is xor and len(input) == 1:
            data = input[0].handle.data
            return self.to_tensor(np.bitwise_xor.reduce(data, axis=self.axis, keepdims=self.keep_dims),
                                  input[0].dtype)
        return slow(self, input)

    apply_impl.dbo_fast_xor = True
    ops.apply_impl = apply_impl
    return True
