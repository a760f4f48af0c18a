"""The FSDP2 wrapper transformers puts around an expert-parallel model, made fit for inference.

``from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=W, ep_size=W, ...))``
wraps the whole model in FSDP2: each dense weight (attention, norms, embeddings, router,
lm_head) is sharded over the ``W`` ranks and all-gathered before every layer of every forward,
and each experts module is an FSDP unit over one rank (its local experts copied into a buffer
around every call). Left as it is, that fails dbo twice:

- FSDP makes a unit's all-gather buffers at its first forward. Made under
  ``torch.inference_mode()`` they are inference tensors: the experts units (one rank) fail at
  once ("Inference tensors do not track version counter"), and the dense units fail the first
  later forward outside inference mode ("Inplace update to inference tensor outside
  InferenceMode").
- Two ubatches inside one layer: the first to finish a layer would free (reshard) the dense
  weights the second is still using; and FSDP's training state, one per unit, is set back by the
  first ubatch to leave, so that even with ``reshard_after_forward=False`` the second one's
  post-forward reshards (the next forward then all-gathers every layer's dense weights again).

:func:`prepare_for_overlap` fixes both, through FSDP's public API: it all-gathers the dense
weights once and keeps them whole (``unshard()``, ``set_reshard_after_forward(False)``, and a
dense unit's reshard made a no-op inside overlapped ubatches), and makes every unit's buffers
outside inference mode. A model loaded with dbo's expert-parallel
implementations gets it at its first forward, whatever mode that runs in:
:func:`prepare_at_first_forward` (called for each experts module as transformers builds dbo's
implementation) holds a forward pre-hook common to all modules (``torch.nn.modules.module.
register_module_forward_pre_hook``, which runs before FSDP's own hooks) until every such model
has been prepared, then removes it. Until then every module call in the process pays one
Python call and an ``isinstance`` check.

What it costs: each rank holds the dense weights whole (``D`` bytes) beside FSDP's ``D / W``
shard, where FSDP alone would hold the units it keeps whole (lm_head and the final norm) plus
one or two layers at a time; the experts stay sharded (``E / W`` per rank). No all-gather per
forward from the first on.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

__all__ = ["prepare_for_overlap", "prepare_at_first_forward", "pending_first_forward",
           "count_all_gathered_bytes", "ALL_GATHER_NAMES"]

logger = logging.getLogger(__name__)

try:
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # pragma: no cover - torch without FSDP2
    FSDPModule = None

# experts modules run through dbo's implementations whose model has not been prepared yet
_pending: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
_hook: Any = None


def _is_experts(module: torch.nn.Module) -> bool:
    return bool(getattr(module, "_is_expert_parallel", False)) or hasattr(module, "_dbo_expert_parallel")


def prepare_for_overlap(model: torch.nn.Module) -> torch.nn.Module:
    """Make a model that transformers loaded with FSDP2 safe to run under
    ``torch.inference_mode()`` and as overlapped ubatches; returns ``model``. A no-op for a
    model without FSDP units and for the units already prepared (a model loaded with dbo's
    implementations is prepared at its first forward, so calling this is never needed).

    Gathers the dense (non-expert) weights once and keeps them whole (each rank then holds them
    whole plus FSDP's own ``1/W`` shard), and creates every unit's FSDP buffers outside inference
    mode. The experts stay sharded (``E / W`` per rank); FSDP still copies a layer's local
    experts into a buffer around each call (over one rank: no communication). Collective over
    the model's FSDP group: call it on every rank, before or at the same forward.

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module``.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"prepare_for_overlap takes a torch.nn.Module, got {type(model).__name__}")
    if FSDPModule is None:  # pragma: no cover
        return model
    units = [m for m in model.modules()
             if isinstance(m, FSDPModule) and not getattr(m, "_dbo_prepared", False)]
    if units:
        # FSDP's buffers made here must not be inference tensors, even if the caller is in inference mode
        with torch.inference_mode(False), torch.no_grad():
            for m in units:
                m.unshard()
                if _is_experts(m):
                    m.reshard()
                else:
                    m.set_reshard_after_forward(False, recurse=False)
                    _keep_whole_in_runs(m)
                m._dbo_prepared = True
        _forget_forward_order_without_grad(model, units)
        logger.info("dbo: %d FSDP units prepared (dense weights kept whole, buffers outside "
                    "inference mode)", len(units))
    if _pending:
        for m in model.modules():
            _pending.discard(m)
    return model


def _keep_whole_in_runs(module: torch.nn.Module) -> None:
    """Make the unit's post-forward reshard a no-op inside overlapped ubatches.

    FSDP skips the reshard after a forward only while the unit's (one, shared) training state
    reads FORWARD. Two ubatches inside one layer both set it at their pre-forward, and the first
    to leave sets it back to IDLE: the second's post-forward then frees the whole weights, and
    the next forward all-gathers them again (the dense weights of every layer, once per
    overlapped call). Reaches into FSDP2's param group (``_get_fsdp_state``); where that is not
    there, a warning says that overlapped calls will re-gather.
    """
    from dbo.ubatch.context import dbo_enabled

    state = getattr(module, "_get_fsdp_state", lambda: None)()
    group = getattr(state, "_fsdp_param_group", False)
    if group is None:
        return  # a unit with no weights of its own
    if not callable(getattr(group, "reshard", None)):
        logger.warning("dbo: cannot reach FSDP's param group of %s: overlapped calls will free and "
                       "re-gather its weights", type(module).__name__)
        return
    reshard = group.reshard

    def reshard_outside_runs() -> None:
        if not dbo_enabled():
            reshard()

    group.reshard = reshard_outside_runs


def _forget_forward_order_without_grad(model: torch.nn.Module, units: list[torch.nn.Module]) -> None:
    """After each forward of ``model`` run without autograd, empty the lists in which FSDP
    records the order of its units' forwards (for the backward's prefetch, which then never
    comes: only a backward empties them, so an inference process grows them by a few KB a call,
    without bound). Reaches into FSDP2's state (``_get_fsdp_state``, its comm context's
    ``post_forward_order``, made at the first forward, and each param group's
    ``_post_forward_indices``), found after the first forward; where that is not there, a
    warning says so."""
    found: list[list] | None = None

    def forget(module: torch.nn.Module, args: Any, output: Any) -> None:
        nonlocal found
        if torch.is_grad_enabled():  # a backward may follow: it reads them
            return
        if found is None:
            found = _forward_order_records(units)
            if not found:
                logger.warning("dbo: cannot reach FSDP's forward-order records: an inference "
                               "process grows them by a few KB per forward")
        for records in found:
            records.clear()

    model.register_forward_hook(forget)


def _forward_order_records(units: list[torch.nn.Module]) -> list[list]:
    lists: list[list] = []
    for m in units:
        state = getattr(m, "_get_fsdp_state", lambda: None)()
        order = getattr(getattr(state, "_comm_ctx", None), "post_forward_order", None)
        if isinstance(order, list) and all(order is not seen for seen in lists):
            lists.append(order)
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            one = getattr(state, "_fsdp_param_group", None)
            groups = [] if one is None else [one]
        for group in groups:
            indices = getattr(group, "_post_forward_indices", None)
            if isinstance(indices, list):
                lists.append(indices)
    return lists


def prepare_at_first_forward(experts: torch.nn.Module) -> None:
    """Have the model that holds ``experts`` :func:`prepare_for_overlap`'d at its first forward
    (before FSDP's own pre-forward, in whatever autograd mode the forward runs)."""
    global _hook
    _pending.add(experts)
    if _hook is None:
        # kept out of torch.compile's graphs, like FSDP's own hooks (wrapped here, not at import,
        # which would import dynamo with this module)
        _hook = torch.nn.modules.module.register_module_forward_pre_hook(
            torch.compiler.disable(_before_forward))


def pending_first_forward() -> bool:
    """Whether a loaded model still waits for its first forward (the global pre-hook is held)."""
    return _hook is not None


def _before_forward(module: torch.nn.Module, args: Any) -> None:
    global _hook
    # FSDP runs a model's root unit first, so the first unit called holds the model's experts
    if _pending and FSDPModule is not None and isinstance(module, FSDPModule) \
            and any(m in _pending for m in module.modules()):
        prepare_for_overlap(module)
    if not _pending and _hook is not None:
        _hook.remove()
        _hook = None
    return None


#: the all-gathers FSDP2 calls by these names in ``torch.distributed`` (``all_gather_single``
#: from torch 2.13 on, ``all_gather_into_tensor`` before)
ALL_GATHER_NAMES = ("all_gather_single", "all_gather_into_tensor")


@contextmanager
def count_all_gathered_bytes() -> Iterator[list[int]]:
    """Count what is all-gathered through ``torch.distributed``'s ``ALL_GATHER_NAMES`` (FSDP2's
    gathers of the dense weights) while the block runs.

    Yields a list that gets the output's size in bytes of each call. The names are put back on
    the way out, also when the block raises. dbo's own backends are not counted: they call
    ``torch.distributed.distributed_c10d`` directly (:mod:`dbo.backends.torchdist`), whichever
    module was imported first.
    """
    import torch.distributed as dist

    counted: list[int] = []

    def counting(real: Any) -> Any:
        def gather(output: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            counted.append(output.numel() * output.element_size())
            return real(output, *args, **kwargs)

        return gather

    with ExitStack() as restore:
        for name in ALL_GATHER_NAMES:
            real = getattr(dist, name, None)
            if real is not None:
                setattr(dist, name, counting(real))
                restore.callback(setattr, dist, name, real)
        yield counted
