"""Hypothesis strategies for ubatch programs (:mod:`dbo.testing.ops`): random cases for the
property tests and the op pools the stateful test draws from."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from dbo.testing.ops import SWITCHING, Case, Op, Program

__all__ = ["SAFE_OPS", "FAULT_OPS", "FINAL_OPS", "cases"]


def _ops(text: str) -> tuple[Op, ...]:
    return tuple(Op.parse(t) for t in text.split())


# Weighted by repetition: yields and hooks are what the schedule is made of.
SAFE_OPS = _ops("Y Y Y Y C K CS KS YC YK R R R H H G0 G1 A0 A1 V")
FAULT_OPS = _ops("X X X R! R! Ry Rr YC YK I")
FINAL_OPS = _ops("Y Y R H C K G0 G1 V")


def _sanitize(ops: list[Op]) -> list[Op]:
    """Make a fault-free op list valid: yield-and-switch only from the stream it names, and no
    second hook registration before a yield (the slot would still be occupied)."""
    out, stream, registered = [], "compute", False
    for op in ops:
        k = op.kind
        if k in ("YC", "YK") and stream != ("compute" if k == "YC" else "comm"):
            op = Op("Y")
        if k == "R" and registered:
            op = Op("H")
        if op.kind in ("C", "CS", "YC"):
            stream = "comm"
        elif op.kind in ("K", "KS", "YK"):
            stream = "compute"
        registered = (registered or op.kind == "R") and op.kind not in SWITCHING
        out.append(op)
    return out


@st.composite
def cases(draw: Any, *, min_ubatches: int = 2, max_ubatches: int = 4, max_ops: int = 8,
          faults: bool | None = None) -> Case:
    """Random :class:`Case`: 2-4 ubatches of up to ``max_ops`` body ops and 2 finally ops.

    ``faults=False`` gives programs that raise nothing on purpose (they can still collide on a
    hook slot when three or more ubatches run); ``True`` injects 1-2 faults (raises,
    KeyboardInterrupt, misbehaving hooks, yield-and-switch from the wrong stream) at random
    places, finally blocks included; None draws which.
    """
    if faults is None:
        faults = draw(st.booleans())
    n = draw(st.integers(min_ubatches, max_ubatches))
    bodies = [draw(st.lists(st.sampled_from(SAFE_OPS), max_size=max_ops)) for _ in range(n)]
    finals = [draw(st.lists(st.sampled_from(FINAL_OPS), max_size=2)) for _ in range(n)]
    bodies = [_sanitize(b) for b in bodies]
    finals = [_sanitize(f) for f in finals]
    if faults:
        for _ in range(draw(st.integers(1, 2))):
            u = draw(st.integers(0, n - 1))
            ops = draw(st.sampled_from([bodies[u]] * 3 + [finals[u]]))
            ops.insert(draw(st.integers(0, len(ops))), draw(st.sampled_from(FAULT_OPS)))
    progs = tuple(Program(tuple(b), tuple(f)) for b, f in zip(bodies, finals, strict=True))
    return Case(progs, draw(st.booleans()), draw(st.booleans()))
