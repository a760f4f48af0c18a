"""torch's mode stacks per ubatch: TorchFunctionMode and TorchDispatchMode stacks, the default
device and saved-tensor hooks.

torch keeps these per OS thread (the default device is a TorchFunctionMode at the bottom of the
function-mode stack, plus two Python-level globals), and the ubatches of a run share one thread.
So the driver (:mod:`dbo.ubatch.driver`) takes the yielding ubatch's stacks off the thread
(:meth:`ModeStacks.take`) and puts the next one's on (:meth:`ModeStacks.put`), the way it
saves and restores grad mode. Between ubatches, and whenever the driver itself runs, the thread
holds no stacks. A ubatch that holds none (the common case) costs the four reads of
:func:`stacks_in_use` per switch.

Only torch functions that torch 2.11 and 2.13 both have are used: ``torch._C``'s
``_len/_pop/_push_on_torch_function_stack`` and ``..._dispatch_stack`` (infra modes such as
``FakeTensorMode`` included), ``torch._C._autograd``'s ``_push/_pop/_top_saved_tensors_default_hooks``
and ``_saved_tensors_hooks_get_disabled_error_message/_disable/_enable``.

The modes themselves are never entered or exited here: taking a stack pops its entries as they
are and putting it pushes them back, so a mode's own ``__enter__``/``__exit__`` bookkeeping stays
with the ubatch that entered it. Also carried, because a mode's ``__enter__``/``__exit__``
writes them: ``torch.set_default_device``'s per-thread slot, ``torch.utils._device.CURRENT_DEVICE``
and ``torch.utils._python_dispatch``'s three "in a dispatch mode" flags (process globals in
torch). Not carried: pre-dispatch modes (process-global in torch, used by export tracing), the
torch-function disabled state (``torch._C.DisableTorchFunction``) and saved-tensor hooks' tracing
flag; do not yield inside those.
"""

from __future__ import annotations

import torch
import torch.utils._device as _torch_device
import torch.utils._python_dispatch as _torch_dispatch

__all__ = ["ModeStacks", "Stacks", "stacks_in_use"]

# Bound once: the driver's yield path calls the first four on every switch.
len_function_stack = torch._C._len_torch_function_stack
len_dispatch_stack = torch._C._len_torch_dispatch_stack
top_saved_hooks = torch._C._autograd._top_saved_tensors_default_hooks
saved_hooks_disabled = torch._C._autograd._saved_tensors_hooks_get_disabled_error_message
_pop_function = torch._C._pop_torch_function_stack
_push_function = torch._C._push_on_torch_function_stack
_pop_dispatch = torch._C._pop_torch_dispatch_stack
_push_dispatch = torch._C._push_on_torch_dispatch_stack
_pop_hooks = torch._C._autograd._pop_saved_tensors_default_hooks
_push_hooks = torch._C._autograd._push_saved_tensors_default_hooks
_enable_hooks = torch._C._autograd._saved_tensors_hooks_enable
_disable_hooks = torch._C._autograd._saved_tensors_hooks_disable
_set_compile_flag = _torch_dispatch.set_is_in_mode_without_ignore_compile_internals
_DEVICE_SLOT = torch._GLOBAL_DEVICE_CONTEXT  # torch.set_default_device's threading.local

#: What :meth:`ModeStacks.take` returns: ``(function_modes, default_device_context,
#: current_device, dispatch_modes, dispatch_flags, saved_hooks, hooks_disabled_message)``,
#: stacks bottom first.
Stacks = tuple


def stacks_in_use() -> bool:
    """True when this thread holds any function or dispatch mode or saved-tensor hooks, or has
    saved-tensor hooks disabled (the driver inlines these four reads)."""
    return bool(len_function_stack() or len_dispatch_stack()
                or top_saved_hooks(True) is not None or saved_hooks_disabled() is not None)


def _dispatch_flags() -> tuple[bool, bool, bool]:
    return (_torch_dispatch._is_in_torch_dispatch_mode,
            _torch_dispatch._is_in_non_infra_torch_dispatch_mode,
            _torch_dispatch._is_in_any_mode_without_ignore_compile_internals)


def _set_dispatch_flags(flags: tuple[bool, bool, bool]) -> None:
    if flags != _dispatch_flags():
        (_torch_dispatch._is_in_torch_dispatch_mode,
         _torch_dispatch._is_in_non_infra_torch_dispatch_mode,
         _torch_dispatch._is_in_any_mode_without_ignore_compile_internals) = flags
        _set_compile_flag(flags[2])


class ModeStacks:
    """Takes mode stacks off this thread and puts them back, for one run.

    Created at the start of the run, in the caller's state: it takes the caller's stacks off
    the thread (:attr:`caller`, None if there were none) and learns what the globals it carries
    hold when no stack is on the thread (:attr:`base`). :meth:`close` puts the caller's back.
    """

    __slots__ = ("base", "caller", "caller_globals")

    def __init__(self) -> None:
        device_context = getattr(_DEVICE_SLOT, "device_context", None)
        self.caller_globals = (device_context, _torch_device.CURRENT_DEVICE, _dispatch_flags())
        # With no mode on the thread: no default device, and the flags as the outermost mode's
        # __enter__ found them (what its __exit__ would put back).
        if device_context is not None:
            base_device = getattr(device_context, "old_device", None)
        else:
            base_device = _torch_device.CURRENT_DEVICE
        base_flags = (False, False, False) if len_dispatch_stack() else _dispatch_flags()
        self.base = (base_device, base_flags)
        self.caller: Stacks | None = self.take() if stacks_in_use() else None

    def take(self) -> Stacks:
        """Pop every stack off this thread and return them; the thread then holds none (and
        the carried globals their :attr:`base` values)."""
        functions = [_pop_function() for _ in range(len_function_stack())]
        functions.reverse()
        dispatch = [_pop_dispatch(None) for _ in range(len_dispatch_stack())]
        dispatch.reverse()
        disabled = saved_hooks_disabled()
        if disabled is not None:
            _enable_hooks()
        hooks = []
        while (top := top_saved_hooks(True)) is not None:
            hooks.append(top)
            _pop_hooks()
        hooks.reverse()
        stacks = (tuple(functions), getattr(_DEVICE_SLOT, "device_context", None),
                  _torch_device.CURRENT_DEVICE, tuple(dispatch), _dispatch_flags(), tuple(hooks),
                  disabled)
        _DEVICE_SLOT.device_context = None
        _torch_device.CURRENT_DEVICE = self.base[0]
        _set_dispatch_flags(self.base[1])
        return stacks

    @staticmethod
    def put(stacks: Stacks) -> None:
        """Push ``stacks`` (from :meth:`take`) onto this thread, which holds none."""
        functions, device_context, current_device, dispatch, flags, hooks, disabled = stacks
        for mode in functions:
            _push_function(mode)
        for mode in dispatch:
            _push_dispatch(mode)  # an infra mode (its ``_mode_key``) goes back to its own slot
        for pack, unpack in hooks:
            _push_hooks(pack, unpack)
        if disabled is not None:
            _disable_hooks(disabled, False)
        _DEVICE_SLOT.device_context = device_context
        _torch_device.CURRENT_DEVICE = current_device
        _set_dispatch_flags(flags)

    def clear(self) -> None:
        """Drop whatever stacks this thread holds (a ubatch that ended left them)."""
        if stacks_in_use():
            self.take()

    def close(self) -> None:
        """Drop what the thread holds and put the caller's stacks and globals back."""
        self.clear()
        if self.caller is not None:
            self.put(self.caller)
        device_context, current_device, flags = self.caller_globals
        _DEVICE_SLOT.device_context = device_context
        _torch_device.CURRENT_DEVICE = current_device
        _set_dispatch_flags(flags)
