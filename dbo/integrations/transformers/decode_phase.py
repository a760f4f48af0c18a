"""The decode phase of a transformers model loaded expert-parallel: :func:`decode_phase` marks
the decode steps, inside which the experts modules that have a decode backend move their tokens
through it (DeepEP's low-latency kernels after a high-throughput prefill, as the ``dbo_deepep``
implementation pairs them). The names are also importable from
:mod:`dbo.integrations.transformers.ep`."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

from dbo.backends import backend_spec

__all__ = ["DEEPEP_LL_MAX_TOKENS", "decode_phase", "decoding", "checked_decode_kwargs"]

#: tokens per rank per call the registered ``dbo_deepep_ll`` takes: its receive buffers are
#: sized for it (and DeepEP caps them at 511 with NVSHMEM's default queue depth). Register
#: another with ``register_ep_implementation(name, "deepep_ll", max_tokens_per_rank=N)``.
DEEPEP_LL_MAX_TOKENS = 256


# Set by decode_phase (each ubatch runs in a copy of the caller's contextvars context).
_DECODING: contextvars.ContextVar[bool] = contextvars.ContextVar("dbo_ep_decoding", default=False)


@contextlib.contextmanager
def decode_phase(active: bool = True) -> Iterator[None]:
    """Inside the block, the experts modules that have a decode backend move their tokens through
    it (``switch_ep_backend(model, "deepep_ht", decode_backend="deepep_ll")``, or the
    ``dbo_deepep`` implementation); the others are unaffected.
    :func:`~dbo.integrations.transformers.generate.greedy_generate` runs its decode steps (not the prefill)
    inside it.

    The backends are collective: every rank of the expert-parallel group must run the same
    calls inside the block (as every rank runs the same decode steps), or the ranks wait on
    different kernels.
    """
    token = _DECODING.set(bool(active))
    try:
        yield
    finally:
        _DECODING.reset(token)


def checked_decode_kwargs(decode_backend: str | None, kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """Checked ``decode_backend_kwargs``: a backend sized by its tokens per call gets
    :data:`DEEPEP_LL_MAX_TOKENS` unless told otherwise."""
    if decode_backend is None:
        if kwargs:
            raise ValueError("decode_backend_kwargs given without decode_backend")
        return {}
    spec = backend_spec(decode_backend, what="decode_backend")
    out = dict(kwargs or {})
    if spec.needs_max_tokens:
        out.setdefault("max_tokens_per_rank", DEEPEP_LL_MAX_TOKENS)
    return out


def decoding() -> bool:
    """Whether the caller is inside :func:`decode_phase` (in this contextvars context)."""
    return _DECODING.get()
