"""Grad, inference and autocast state per ubatch: capture it cheaply, put it back exactly.

PyTorch keeps these modes per OS thread, and the ubatches of a run share one thread, so the
driver (:mod:`dbo.ubatch.driver`) captures the yielding ubatch's modes at every switch and sets the
next one's. :class:`ModeRestorer` owns the one inference-mode guard that makes the caller's
state come back at the end of the run, whatever the ubatches did.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["AUTOCAST_DEVICES", "ModeRestorer", "capture_modes", "is_any_autocast_enabled",
           "is_grad_enabled", "is_inference_mode_enabled"]

AUTOCAST_DEVICES = ("cpu", "cuda")

# Bound once: the driver's yield path calls these on every switch.
is_grad_enabled = torch._C.is_grad_enabled
is_inference_mode_enabled = torch._C.is_inference_mode_enabled
is_any_autocast_enabled = torch._C._is_any_autocast_enabled


def capture_modes() -> int | tuple:
    """Grad, inference and autocast state of this thread, cheap to compare.

    Without autocast (the common case) it is the int ``grad | inference << 1``; with autocast
    on for any device, the tuple ``(grad, inference, autocast)``.
    """
    if is_any_autocast_enabled():
        # _autocast_state() inlined: the driver calls this at every switch under autocast.
        autocast = tuple(
            (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in AUTOCAST_DEVICES
        ) + (torch.is_autocast_cache_enabled(),)
        return (is_grad_enabled(), is_inference_mode_enabled(), autocast)
    return is_grad_enabled() | is_inference_mode_enabled() << 1


def _expand_modes(modes: int | tuple) -> tuple:
    if isinstance(modes, int):
        return (bool(modes & 1), bool(modes & 2), None)
    return modes


def _autocast_state() -> tuple:
    """``((enabled, dtype) per device in AUTOCAST_DEVICES) + (cache_enabled,)``."""
    return tuple(
        (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in AUTOCAST_DEVICES
    ) + (torch.is_autocast_cache_enabled(),)


class ModeRestorer:
    """Sets this thread's grad/inference/autocast state to a captured one, and puts the
    caller's back at the end of the run.

    Inference mode has no setter in torch, only a RAII guard (``torch._C._InferenceMode``) whose
    destruction restores the whole autograd state and dispatch-key set it saw when it was
    created. So at the start of the run, in the caller's state, the restorer creates one *base*
    guard with the caller's own inference flag (a no-op change) that saves exactly the caller's
    state. To change the inference flag at a switch, it drops the guard it holds (back to the
    caller's state) and creates a new one from there, which again saves the caller's state. It
    therefore holds exactly one guard at any time, always saving the caller's state, and
    dropping it in ``close`` restores the caller whatever guards the ubatches created and
    destroyed in between. Ubatches' own guards are created and destroyed while the thread holds
    that ubatch's state, so they restore it.

    The autocast dtypes are not part of that state: a ubatch whose autocast is off gets the
    caller's dtypes (known limit: a dtype set inside a disabled autocast block is not carried).
    """

    live_guards = 0  # guards held by restorers of this process (a test checks it returns to 0)

    __slots__ = ("caller", "caller_autocast", "caller_fw_mt", "guard")

    def __init__(self, caller: int | tuple) -> None:
        self.caller = _expand_modes(caller)
        self.caller_autocast = _autocast_state()
        self.caller_fw_mt = (torch._C._is_fwd_grad_enabled(), torch._C._is_multithreading_enabled())
        self.guard: Any = None
        self._new_guard(self.caller[1])

    def _new_guard(self, inference: bool) -> None:
        # The guard sets grad, forward-grad and multithreading to `not inference`: the caller's
        # own values are put back (for the base guard they are the state the guard changed).
        self.guard = torch._C._InferenceMode(inference)
        ModeRestorer.live_guards += 1
        torch._C._set_grad_enabled(self.caller[0])
        fw, mt = self.caller_fw_mt
        if inference == self.caller[1]:
            torch._C._set_fwd_grad_enabled(fw)
            torch._C._set_multithreading_enabled(mt)

    def _drop_guard(self) -> None:
        if self.guard is not None:
            self.guard = None  # destroying it restores the caller's autograd state and key set
            ModeRestorer.live_guards -= 1

    def apply(self, want: int | tuple, have: int | tuple) -> None:
        """Change this thread's modes from ``have`` (what it holds now) to ``want`` (both as
        :func:`capture_modes` returns them)."""
        want, have = _expand_modes(want), _expand_modes(have)
        had_autocast = have[2]
        if want[1] != have[1]:
            self._drop_guard()
            self._new_guard(want[1])  # always one held, so that dropping it restores the caller
            # The guard swap reset the autocast keys (not the dtypes) to the caller's.
            have = _expand_modes(capture_modes())
        if want[0] != have[0]:
            torch._C._set_grad_enabled(want[0])
        if want[2] != have[2] or want[2] != had_autocast:
            self._set_autocast(want[2])

    def _set_autocast(self, autocast: tuple | None) -> None:
        if autocast is None:  # off everywhere, with the caller's dtypes
            autocast = tuple((False, dtype) for _, dtype in self.caller_autocast[:-1]) \
                + (self.caller_autocast[-1],)
        for d, (enabled, dtype) in zip(AUTOCAST_DEVICES, autocast[:-1], strict=True):
            torch.set_autocast_enabled(d, enabled)
            torch.set_autocast_dtype(d, dtype)
        torch.set_autocast_cache_enabled(autocast[-1])

    def close(self) -> None:
        """Restore the caller's state (drop the guard, then grad and autocast)."""
        self._drop_guard()
        if torch.is_grad_enabled() != self.caller[0]:
            torch._C._set_grad_enabled(self.caller[0])
        if _autocast_state() != self.caller_autocast:
            self._set_autocast(self.caller_autocast)
