"""The ubatch program language and the log it produces, shared by the model and the interpreter.

A program is data (STYLE.md: a schedule is data). Each :class:`Op` has a compact string form
that :meth:`Op.parse` reads back; a :class:`Case` prints as one line per ubatch, body and
``finally`` ops separated by ``|``::

    ub0: Y R Y | Y
    ub1: CS H KS

Ops (``<u><b|f><k>`` names the op: ubatch, body or finally, index; it tags hooks, raises and
contextvar values so that every one is unique):

====  ======================================================================================
Y     ``dbo_yield()``
C K   ``dbo_switch_to_comm()`` / ``dbo_switch_to_compute()``
CS KS ``dbo_switch_to_comm_sync()`` / ``dbo_switch_to_compute_sync()``
YC    ``dbo_yield_and_switch_from_compute_to_comm()`` (StreamStateError unless on compute)
YK    ``dbo_yield_and_switch_from_comm_to_compute()`` (StreamStateError unless on comm)
R     register a recv hook that logs; ``R!`` one that logs then raises; ``Ry`` one that logs
      then calls ``dbo_yield`` and ``Rr`` one that logs then registers a hook (both misuse)
H     ``dbo_maybe_run_recv_hook()``
G0 G1 grad mode off / on (``torch.set_grad_enabled``)
A0 A1 CPU autocast off / on (``torch.set_autocast_enabled("cpu", ...)``)
V     set the test contextvar to this op's name
X     raise ``ProgramError(name)``;  I: raise ``KeyboardInterrupt(name)``
END   return from the body (only used when a program is fed one op at a time)
====  ======================================================================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = [
    "OP_KINDS",
    "HOOK_KINDS",
    "SWITCHING",
    "Op",
    "Program",
    "Case",
    "Event",
    "Outcome",
    "Prediction",
    "op_name",
    "describe_raise",
]

#: op kinds, in their compact string form
OP_KINDS = ("Y", "C", "K", "CS", "KS", "YC", "YK", "R", "H", "G", "A", "V", "X", "I", "END")
#: what a registered hook does after logging: "" nothing, "!" raise, "y" yield, "r" register
HOOK_KINDS = ("", "!", "y", "r")
#: ops that may switch to another ubatch
SWITCHING = frozenset({"Y", "YC", "YK"})

# The descriptions the logs use for exceptions, shared by the model and the interpreter.
GREENLET_EXIT = "GreenletExit"
HOOK_MISUSE = "HookMisuseError"
SLOT_OCCUPIED = "HookSlotOccupiedError"
STREAM_STATE = "StreamStateError"


def op_name(ub: int, section: str, index: int) -> str:
    """Name of the op at ``index`` of ubatch ``ub``'s body (``section="b"``) or finally ("f")."""
    return f"{ub}{section}{index}"


def describe_raise(kind: str, name: str) -> str:
    """Log description of the exception an ``X``/``I`` op or a ``R!`` hook raises."""
    return ("kbd:" if kind == "I" else "err:") + name


@dataclass(frozen=True)
class Op:
    """One step of a ubatch program. ``arg`` is the hook kind for ``R``, 0/1 for ``G``/``A``."""

    kind: str
    arg: str = ""

    def __post_init__(self) -> None:
        if self.kind not in OP_KINDS:
            raise ValueError(f"unknown op kind {self.kind!r}")
        if self.kind == "R" and self.arg not in HOOK_KINDS:
            raise ValueError(f"unknown hook kind {self.arg!r}")
        if self.kind in ("G", "A") and self.arg not in ("0", "1"):
            raise ValueError(f"{self.kind} takes 0 or 1, got {self.arg!r}")

    def __str__(self) -> str:
        return self.kind + self.arg

    @classmethod
    def parse(cls, text: str) -> Op:
        for kind in sorted(OP_KINDS, key=len, reverse=True):
            if text.startswith(kind) and (kind in ("R", "G", "A") or text == kind):
                return cls(kind, text[len(kind):])
        raise ValueError(f"cannot parse op {text!r}")


@dataclass(frozen=True)
class Program:
    """One ubatch's ops: ``body`` runs inside ``try``; ``final`` in its ``finally``."""

    body: tuple[Op, ...] = ()
    final: tuple[Op, ...] = ()

    def __str__(self) -> str:
        s = " ".join(map(str, self.body))
        return f"{s} | {' '.join(map(str, self.final))}" if self.final else s

    @classmethod
    def parse(cls, text: str) -> Program:
        body, _, final = text.partition("|")
        return cls(tuple(Op.parse(t) for t in body.split()), tuple(Op.parse(t) for t in final.split()))


@dataclass(frozen=True)
class Case:
    """Programs for ubatches 0..N-1 and the caller's state when ``run_ubatches`` is called."""

    programs: tuple[Program, ...]
    caller_grad: bool = True
    caller_autocast: bool = False
    caller_var: str = "caller"

    def __str__(self) -> str:
        head = f"caller: grad={int(self.caller_grad)} autocast={int(self.caller_autocast)}"
        return "\n".join([head] + [f"ub{i}: {p}" for i, p in enumerate(self.programs)])

    @classmethod
    def parse(cls, text: str, **caller: Any) -> Case:
        progs = []
        for line in text.strip().splitlines():
            _, _, rest = line.partition(":")
            progs.append(Program.parse(rest))
        return cls(tuple(progs), **caller)


@dataclass(frozen=True)
class Event:
    """One log line. ``obs`` is what the code observed: (ubatch id, stream, grad, autocast, var).

    kinds: ``start`` (the ubatch's callable began), ``op`` (op ``name`` completed), ``hook``
    (a hook registered at op ``name`` ran; ``ub`` is the ubatch that ran it), ``finally``
    (``detail``: the exception propagating, or ``-``), ``return`` (the callable returned).
    """

    kind: str
    ub: int
    name: str = ""
    detail: str = ""
    obs: tuple = ()

    def __str__(self) -> str:
        parts = [f"ub{self.ub}", self.kind]
        if self.name:
            parts.append(self.name)
        if self.detail:
            parts.append(self.detail)
        if self.obs:
            uid, stream, grad, autocast, var = self.obs
            parts.append(f"[id={uid} {stream} grad={int(grad)} ac={int(autocast)} var={var}]")
        return " ".join(parts)


@dataclass(frozen=True)
class Outcome:
    """How ``run_ubatches`` ended.

    ``error`` is None (success, ``results`` holds each ubatch's return value),
    ``"UBatchError(<id>, <cause>)"`` or ``"KeyboardInterrupt(<cause>)"``. ``started`` says which
    ubatches ever ran; ``unwind_logged`` lists, in order, the ubatches whose unwinding raised
    something other than GreenletExit (logged, not raised).
    """

    error: str | None
    results: tuple | None
    started: tuple[bool, ...]
    unwind_logged: tuple[int, ...] = ()


@dataclass(frozen=True)
class Prediction:
    """The log, the outcome, and the schedule: ``("resume", ub)`` each time a ubatch starts or
    is resumed, ``("unwind", ub)`` each time GreenletExit is thrown into one, in order."""

    events: tuple[Event, ...]
    outcome: Outcome
    schedule: tuple[tuple[str, int], ...] = ()
