"""Launching Triton kernels with less host time (the fused experts', the row copies'), and
whether a tensor's kernels run on Triton at all (:func:`use_triton_for`: on CUDA tensors where
Triton is importable; the callers' plain-torch paths otherwise).

``kernel[grid](*args, **kwargs)`` costs 11-35 us of host time per launch on the GPU host
(Triton 3.6: binding and specializing every argument, building the cache key from the options'
string, the global-variable check), against ~5 us for the compiled kernel's launcher alone, and
a TMA descriptor argument adds ~10 us more (the descriptor object, then ``cuTensorMapEncodeTiled``
at every launch). The experts launch four to five kernels per call, so at small sizes the host,
not the GPU, set their time (docs/performance.md).

:func:`launch` keeps each compiled kernel under the key that Triton itself specializes on (each
argument's type, a pointer's 16-byte alignment, an integer's divisibility by 16 and whether it
is 1, a tensor descriptor's dtype and block; the compile-time arguments; the options; the
device) and calls its launcher's C entry point directly on the next call with the same key.
A TMA descriptor is passed as a :class:`Desc` (the tensor and the block): its encoded form is a
pure function of the tensor's address, shape, strides and dtype and of the block, so it is kept
under those values (a weight's descriptor is encoded once; an activation's again only when the
allocator hands out another address). The first call of a key, and every call where the direct
path does not apply (another Triton than the one it was written for, Triton's interpreter, a
launch hook installed, a kernel that needs scratch memory, ``DBO_TRITON_FAST_LAUNCH=0``), goes
through ``kernel[grid]`` as before.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

__all__ = ["HAVE_TRITON", "use_triton_for", "Desc", "launch", "fast_launch_enabled", "clear_launch_cache",
           "cdiv", "next_pow2"]

#: whether ``triton`` (and ``triton.language``, which the kernels' modules import) is importable
try:
    import triton.language  # noqa: F401
    HAVE_TRITON = True
except ImportError:  # CPU-only installs: the callers take their plain-torch paths
    HAVE_TRITON = False

try:
    import triton
    from triton.runtime.jit import JITFunction
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # the module is only used where Triton is importable
    triton = None

#: the Triton versions whose launcher (``CompiledKernel.run``, ``CudaLauncher``, the C
#: ``launch``'s leading arguments) this module was written against
_VERSIONS = ("3.6.",)
_OPTIONS = frozenset({"num_warps", "num_stages", "num_ctas", "maxnreg"})
#: encoded descriptors kept per compiled kernel and descriptor argument (an LRU would do no better:
#: a steady loop reuses a handful of addresses)
_MAX_DESCS = 64


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints (``triton.cdiv`` is a constexpr function: ~1 us per host call)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (>= 1), for ints."""
    return 1 << max(0, n - 1).bit_length()


def use_triton_for(t: torch.Tensor, use_triton: bool | None = None) -> bool:
    """Whether the Triton kernels run on ``t``: ``use_triton`` if given (True raises when
    Triton is missing), else on CUDA tensors when Triton is importable."""
    if use_triton is None:
        return HAVE_TRITON and t.is_cuda
    if use_triton and not HAVE_TRITON:
        raise ValueError("use_triton=True but triton is not importable (pip install triton)")
    return use_triton


class Desc(NamedTuple):
    """A TMA descriptor argument of :func:`launch`: a 2-D (or higher) tensor with contiguous
    rows and 16-byte aligned base and row strides, and the block each load or store moves;
    ``layout``: a Gluon kernel's descriptor, with the shared-memory layout of its block."""

    tensor: torch.Tensor
    block: tuple[int, ...]
    layout: object = None

    def descriptor(self):
        if self.layout is not None:
            from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

            return GluonDescriptor.from_tensor(self.tensor, list(self.block), self.layout)
        return TensorDescriptor.from_tensor(self.tensor, list(self.block))


class _Direct:
    """A compiled kernel's C launcher and what it takes besides the call's arguments."""

    __slots__ = ("compiled", "raw", "coop", "pdl", "consts", "metas", "memos")

    def __init__(self, compiled, raw, consts: tuple, metas: list | None):
        self.compiled = compiled
        self.raw = raw  # None: call compiled.run (which takes the descriptors as objects)
        run = compiled.run
        self.coop = getattr(run, "launch_cooperative_grid", False)
        self.pdl = getattr(run, "launch_pdl", False)
        self.consts = consts
        self.metas = metas  # per Desc argument: Triton's descriptor metadata (None: no Desc)
        self.memos: list[dict] = [{} for _ in metas or ()]


_ENABLED: list[bool] = []  # computed at the first launch (and again after clear_launch_cache)
#: key -> the compiled kernel and how to launch it
_CACHE: dict[tuple, _Direct] = {}


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
    t = type(a)
    if t is torch.Tensor or isinstance(a, torch.Tensor):
        return a.dtype, not a.data_ptr() & 15
    if t is Desc:
        return Desc, a.tensor.dtype, a.block, a.layout
    if t is bool or a is None:
        return a
    if t is int:
        return a == 1, not a & 15, -(2 ** 31) <= a < 2 ** 31
    if t is float:
        return float
    if isinstance(a, TensorDescriptor):
        return Desc, a.base.dtype, tuple(a.block_shape), a.padding
    raise TypeError(t)


_RUNTIME = getattr(getattr(triton, "knobs", None), "runtime", None)


def _hooks_installed() -> bool:
    rt = _RUNTIME
    return bool(getattr(getattr(rt, "launch_enter_hook", None), "calls", None)
                or getattr(getattr(rt, "launch_exit_hook", None), "calls", None))


def _descriptors(args: tuple) -> tuple:
    return tuple(a.descriptor() if type(a) is Desc else a for a in args)


def _direct(compiled, consts: tuple, n_desc: int) -> _Direct:
    """``compiled`` with the C entry point of its launcher (Triton 3.6's ``CudaLauncher``), or
    without one (``compiled.run``) where the kernel needs scratch memory or the launcher is not
    laid out as expected."""
    run = compiled.run
    if getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):
        return _Direct(compiled, None, consts, None)
    raw = getattr(run, "launch", None)
    metas = None
    if n_desc:  # run.launch wraps the C launcher to encode the descriptors: take the C one
        code = getattr(raw, "__code__", None)
        if code is None or "launcher" not in code.co_freevars:
            return _Direct(compiled, None, consts, None)
        raw = raw.__closure__[code.co_freevars.index("launcher")].cell_contents
        metas = list(getattr(compiled.metadata, "tensordesc_meta", None) or [None] * n_desc)
        if len(metas) != n_desc:
            return _Direct(compiled, None, consts, None)
    return _Direct(compiled, raw, consts, metas)


def _encoded(d: _Direct, j: int, a: Desc) -> list:
    from triton.backends.nvidia.driver import make_tensordesc_arg

    if d.metas[j] is None:  # decomposed into the tensor and its shape: nothing to keep
        return make_tensordesc_arg(a.descriptor(), None)
    t = a.tensor
    key = (t.data_ptr(), t.shape, t.stride(), t.dtype, a.block, a.layout)
    memo = d.memos[j]
    hit = memo.get(key)
    if hit is None:
        if len(memo) >= _MAX_DESCS:
            memo.clear()
        hit = memo[key] = make_tensordesc_arg(a.descriptor(), d.metas[j])
    return hit


def launch(kernel, grid: tuple[int, ...], args: tuple, kwargs: dict):
    """``kernel[grid](*args, **kwargs)``, with the compiled kernel's launcher called directly
    where a call with the same specialization compiled it before. ``args`` are the kernel's
    leading parameters (a :class:`Desc` where the kernel takes a tensor descriptor),
    ``kwargs`` its remaining (compile-time) parameters by name and the launch options
    (``num_warps``, ``num_stages``). Returns the compiled kernel."""
    if not (isinstance(kernel, JITFunction) and fast_launch_enabled()) or _hooks_installed():
        return kernel[grid](*_descriptors(args), **kwargs)
    device = torch._C._cuda_getDevice()
    try:
        # id(kernel): a JITFunction hashes through its source's cache key (a lock and a property)
        key = (id(kernel), device, tuple(kwargs.items()), *map(_spec, args))
    except TypeError:  # an argument this module does not know how Triton specializes
        return kernel[grid](*_descriptors(args), **kwargs)
    hit = _CACHE.get(key)
    if hit is None:
        compiled = kernel[grid](*_descriptors(args), **kwargs)
        rest = kernel.arg_names[len(args):]
        if compiled is not None and set(rest) == set(kwargs) - _OPTIONS:
            consts = tuple(kwargs[n] for n in rest)
            _CACHE[key] = _direct(compiled, consts, sum(type(a) is Desc for a in args))
        return compiled
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    stream = torch._C._cuda_getCurrentRawStream(device)
    c = hit.compiled
    if hit.raw is None:
        c.run(grid[0], g1, g2, stream, c.function, c.packed_metadata, None, None, None,
              *_descriptors(args), *hit.consts)
        return c
    if hit.metas is None:
        final = args
    else:
        final, j = [], 0
        for a in args:
            if type(a) is Desc:
                final.extend(_encoded(hit, j, a))
                j += 1
            else:
                final.append(a)
    hit.raw(grid[0], g1, g2, stream, c.function, hit.coop, hit.pdl, None, None, c.packed_metadata,
            None, None, None, *final, *hit.consts)
    return c
