"""A converted model as rank ``r`` of an emulated expert-parallel group of ``N`` ranks.

The ``emulated`` backend (:mod:`dbo.backends.emulated`) plays one rank of a group on this process
alone, with no process group. A model converted for it keeps the ``E / N`` experts of that rank:
:func:`~dbo.integrations.transformers.convert.convert_to_expert_parallel` and
:func:`~dbo.integrations.transformers.use_backend` take an
:class:`~dbo.backends.emulated.EmulatedGroup` where they take a process group, and the group's
size, rank and hosts become the backend's ``ep_size``, ``rank`` and ``gpus_per_host``::

    group = EmulatedGroup(16, 0)          # rank 0 of EP 16, 8 GPUs a host
    convert_to_expert_parallel(model, group, "emulated", layout="deepep_ht", link=link,
                               max_tokens_per_rank=8 * 2048)

The rank's own tokens stand in for its peers' (:func:`dbo.moe.validate.stand_in_local_ids`), so
the model's output is that of the single-process model whose routers send token ``t`` to
experts ``r * E / N + ids[t] % (E / N)``.
"""

from __future__ import annotations

from typing import Any

from dbo.backends import backend_spec
from dbo.backends.emulated import EmulatedGroup

__all__ = ["EmulatedGroup", "ep_rank_size", "backend_group_options"]


def ep_rank_size(group: Any) -> tuple[int, int]:
    """``(rank, size)`` of the expert-parallel ``group``: an :class:`EmulatedGroup`'s own, else
    the process group's (None: the default group).

    Raises:
        RuntimeError: a process group is meant and torch.distributed is not initialised.
    """
    if isinstance(group, EmulatedGroup):
        return group.rank(), group.size()
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("convert_to_expert_parallel needs an initialized torch.distributed "
                           "process group (a group of one is fine), or an EmulatedGroup to play one "
                           "rank of a larger group with the emulated backend")
    return dist.get_rank(group), dist.get_world_size(group)


def backend_group_options(name: str, group: Any, options: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The group and options that :func:`dbo.backends.make_backend` builds backend ``name`` with
    for a model made expert-parallel over ``group``: an :class:`EmulatedGroup`'s size, rank and
    hosts as the emulated backend's ``ep_size``, ``rank`` and ``gpus_per_host`` (and no process
    group), anything else unchanged.

    Raises:
        ValueError: an :class:`EmulatedGroup` with a backend that needs a process group, or
            options that name another group than it; the emulated backend over another group.
    """
    if not isinstance(group, EmulatedGroup):
        if backend_spec(name).emulated:
            raise ValueError(f"backend {name!r} plays one rank of a group alone: make the model "
                             "expert-parallel over group=EmulatedGroup(N, rank) (the experts it holds "
                             "are that rank's)")
        return group, options
    if not backend_spec(name).emulated:
        raise ValueError(f"backend {name!r} moves tokens between the ranks of a process group; a model "
                         f"made expert-parallel over an EmulatedGroup (rank {group.rank()} of "
                         f"{group.size()}, no peers) runs the emulated backend")
    out = dict(options)
    for key, value in (("ep_size", group.size()), ("rank", group.rank()),
                       ("gpus_per_host", group.gpus_per_host)):
        if out.setdefault(key, value) != value:
            raise ValueError(f"{key}={out[key]!r}: the model holds the experts of rank {group.rank()} of "
                             f"{group.size()} ({group.gpus_per_host} GPUs a host); leave {key} out")
    return None, out
