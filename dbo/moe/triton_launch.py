"""Launching the fused experts' Triton kernels with less host time.

``kernel[grid](*args, **kwargs)`` costs 11-35 us of host time per launch on the GPU host
(Triton 3.6: binding and specializing every argument, building the cache key from the options'
string, the global-variable check), against ~5 us for the compiled kernel's launcher alone
(``tests/gpu/probe_launch_cost.py``). The experts launch four to five kernels per call, so at
small sizes the host, not the GPU, set their time (docs/perf_notes.md section 5).

:func:`launch` keeps each compiled kernel under the key that Triton itself specializes on (each
argument's type, a pointer's 16-byte alignment, an integer's divisibility by 16 and whether it
is 1, a tensor descriptor's block; the compile-time arguments; the options; the device) and
calls its launcher directly on the next call with the same key. The first call of a key, and
every call where the direct path does not apply (another Triton than the one it was written
for, Triton's interpreter, a launch hook installed, ``DBO_TRITON_FAST_LAUNCH=0``), goes through
``kernel[grid]`` as before.
"""

from __future__ import annotations

import os

import torch

__all__ = ["launch", "fast_launch_enabled", "clear_launch_cache"]

try:
    import triton
    from triton.runtime.jit import JITFunction
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # the module is only used where Triton is importable
    triton = None

#: the Triton versions whose ``CompiledKernel.run`` signature this module was written against
_VERSIONS = ("3.6.",)
_OPTIONS = frozenset({"num_warps", "num_stages", "num_ctas", "maxnreg"})
#: key -> (compiled kernel, the compile-time arguments in the kernel's parameter order)
_CACHE: dict[tuple, tuple[object, tuple]] = {}


_ENABLED: list[bool] = []  # computed at the first launch (and again after clear_launch_cache)


def fast_launch_enabled() -> bool:
    """Whether :func:`launch` may call compiled kernels' launchers directly (read once from the
    environment: ``DBO_TRITON_FAST_LAUNCH=0`` turns it off)."""
    if not _ENABLED:
        _ENABLED.append(triton is not None and triton.__version__.startswith(_VERSIONS)
                        and os.environ.get("DBO_TRITON_FAST_LAUNCH", "1") != "0"
                        and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"))
    return _ENABLED[0]


def clear_launch_cache() -> None:
    """Forget the compiled kernels kept by :func:`launch`, and read the environment again."""
    _CACHE.clear()
    _ENABLED.clear()


def _spec(a) -> object:
    # what Triton 3.6 specializes an argument on (triton.runtime.jit's binder)
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if isinstance(a, bool) or a is None:
        return a
    if isinstance(a, int):
        return int, a == 1, a % 16 == 0, -(2 ** 31) <= a < 2 ** 31
    if isinstance(a, float):
        return float
    if isinstance(a, TensorDescriptor):
        return TensorDescriptor, a.base.dtype, tuple(a.block_shape), a.padding
    raise TypeError(type(a))


def _hooks_installed() -> bool:
    knobs = getattr(triton, "knobs", None)
    rt = getattr(knobs, "runtime", None)
    return any(getattr(getattr(rt, h, None), "calls", None)
               for h in ("launch_enter_hook", "launch_exit_hook"))


def launch(kernel, grid: tuple[int, ...], args: tuple, kwargs: dict):
    """``kernel[grid](*args, **kwargs)``, with the compiled kernel's launcher called directly
    where a call with the same specialization compiled it before. ``args`` are the kernel's
    leading parameters, ``kwargs`` its remaining (compile-time) parameters by name and the
    launch options (``num_warps``, ``num_stages``). Returns the compiled kernel."""
    if not (isinstance(kernel, JITFunction) and fast_launch_enabled()) or _hooks_installed():
        return kernel[grid](*args, **kwargs)
    device = torch.cuda.current_device()
    try:
        key = (kernel, tuple(_spec(a) for a in args), tuple(sorted(kwargs.items())), device)
    except TypeError:  # an argument this module does not know how Triton specializes
        return kernel[grid](*args, **kwargs)
    hit = _CACHE.get(key)
    if hit is None:
        compiled = kernel[grid](*args, **kwargs)
        rest = kernel.arg_names[len(args):]
        if compiled is not None and set(rest) == set(kwargs) - _OPTIONS:
            _CACHE[key] = (compiled, tuple(kwargs[n] for n in rest))
        return compiled
    compiled, consts = hit
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    compiled.run(grid[0], g1, g2, torch._C._cuda_getCurrentRawStream(device), compiled.function,
                 compiled.packed_metadata, None, None, None, *args, *consts)
    return compiled
