"""Input checks shared by the backends and experts: clear errors that name the argument.

Caller mistakes raise ``TypeError`` (wrong type or dtype) or ``ValueError`` (wrong shape,
value or size). Range checks on ``topk_ids`` read the tensor (a device sync on GPU): the
backends read device ids at their first call only (:class:`IdsRangeCheck`), so a step does not
make the host wait for the GPU; callers can ask for every call, or turn the checks off.
"""

from __future__ import annotations

import torch

__all__ = [
    "ACTIVATION_DTYPES",
    "check_routing_inputs",
    "IdsRangeCheck",
    "check_expert_weights",
    "contiguous_expert_map",
    "num_local_experts_for",
    "stand_in_local_ids",
]

#: activation dtypes the reference experts and the torch.distributed backends accept
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _need_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


class IdsRangeCheck:
    """When a backend reads ``topk_ids`` back to check their range.

    CPU ids are read at every call (no sync). Device ids are read at the first call only, unless
    ``every_call``: the read is a device sync, and one per dispatch makes the host wait for the
    GPU at every layer (twice per layer under DBO), which starves the GPU of queued work. Later
    calls with out-of-range ids are the caller's error: the torch.distributed backends drop ids
    outside this rank's experts and a device-side index check fails on the rest.
    """

    def __init__(self, every_call: bool = False):
        self.every_call = every_call
        self._read_device = False

    def __call__(self, topk_ids: torch.Tensor) -> bool:
        """Whether this call should read ``topk_ids``."""
        if self.every_call or topk_ids.device.type == "cpu":
            return True
        if self._read_device:
            return False
        self._read_device = True
        return True


def check_routing_inputs(
    a1: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    *,
    hidden_size: int | None = None,
    dtypes: tuple[torch.dtype, ...] = ACTIVATION_DTYPES,
    check_ids_range: bool = True,
    apply_router_weight_on_input: bool = False,
) -> None:
    """Check the arguments of ``prepare`` / ``MoEKernel.forward``.

    Args:
        a1: ``[M, hidden]`` activations of a dtype in ``dtypes``.
        topk_weights: ``[M, topk]`` float32.
        topk_ids: ``[M, topk]`` int32/int64, entries in ``[-1, num_experts)``.
        num_experts: the global number of experts, > 0.
        hidden_size: if given, ``a1.shape[1]`` must equal it.
        check_ids_range: read ``topk_ids`` to check its range (a sync on GPU).
        apply_router_weight_on_input: then ``topk`` must be 1.
    """
    _need_tensor("a1 (hidden_states)", a1)
    _need_tensor("topk_weights", topk_weights)
    _need_tensor("topk_ids", topk_ids)
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts <= 0:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    if a1.dim() != 2:
        raise ValueError(f"a1 (hidden_states) must be [num_tokens, hidden], got shape {tuple(a1.shape)}")
    if a1.dtype not in dtypes:
        raise TypeError(f"a1 (hidden_states) has dtype {a1.dtype}; supported: "
                        f"{', '.join(str(d) for d in dtypes)}")
    if a1.shape[1] == 0:
        raise ValueError("a1 (hidden_states) has hidden size 0")
    if hidden_size is not None and a1.shape[1] != hidden_size:
        raise ValueError(f"a1 (hidden_states) has hidden size {a1.shape[1]}, but this backend was "
                         f"built for hidden_size={hidden_size}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if topk_weights.dtype != torch.float32:
        raise TypeError(f"topk_weights must be float32, got {topk_weights.dtype}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != a1.shape[0]:
        raise ValueError(f"topk_ids must be [num_tokens={a1.shape[0]}, topk], got shape "
                         f"{tuple(topk_ids.shape)}")
    if topk_ids.shape[1] == 0:
        raise ValueError("topk_ids has topk = 0 columns")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights has shape {tuple(topk_weights.shape)}, topk_ids "
                         f"{tuple(topk_ids.shape)}: they must match")
    if topk_ids.device != a1.device or topk_weights.device != a1.device:
        raise ValueError(f"a1, topk_weights and topk_ids must be on one device, got {a1.device}, "
                         f"{topk_weights.device}, {topk_ids.device}")
    if apply_router_weight_on_input and topk_ids.shape[1] != 1:
        raise ValueError("apply_router_weight_on_input needs topk == 1, got topk = "
                         f"{topk_ids.shape[1]}")
    if check_ids_range and topk_ids.numel():
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < -1 or hi >= num_experts:
            raise ValueError(f"topk_ids must lie in [-1, num_experts={num_experts}), got values in "
                             f"[{lo}, {hi}]")


def check_expert_weights(w1: torch.Tensor, w2: torch.Tensor, hidden: int,
                         dtype: torch.dtype, num_local_experts: int | None = None) -> int:
    """Check SwiGLU weights ``w1 [L, 2I, hidden]`` and ``w2 [L, hidden, I]``; return ``L``."""
    _need_tensor("w1", w1)
    _need_tensor("w2", w2)
    if w1.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"w1 and w2 must be 3-D, got shapes {tuple(w1.shape)}, {tuple(w2.shape)}")
    n_local, two_inter, h1 = w1.shape
    if h1 != hidden:
        raise ValueError(f"w1 has hidden size {h1}, the activations {hidden}")
    if two_inter % 2:
        raise ValueError(f"w1's second dim (2 * intermediate) is odd: {two_inter}")
    if tuple(w2.shape) != (n_local, hidden, two_inter // 2):
        raise ValueError(f"w2 must be [{n_local}, {hidden}, {two_inter // 2}] to match w1 "
                         f"{tuple(w1.shape)}, got {tuple(w2.shape)}")
    if w1.dtype != dtype or w2.dtype != dtype:
        raise TypeError(f"w1/w2 dtypes {w1.dtype}/{w2.dtype} differ from the activations' {dtype}")
    if num_local_experts is not None and n_local != num_local_experts:
        raise ValueError(f"w1 holds {n_local} experts, expected {num_local_experts} local experts")
    return n_local


def num_local_experts_for(num_experts: int, world_size: int) -> int:
    """Experts per rank under the contiguous placement; ``num_experts`` must divide evenly."""
    if num_experts % world_size:
        raise ValueError(f"num_experts={num_experts} is not a multiple of the EP world size "
                         f"{world_size}")
    return num_experts // world_size


def contiguous_expert_map(num_experts: int, world_size: int, rank: int,
                          device: torch.device | str = "cpu") -> torch.Tensor:
    """``[num_experts]`` int32: local id of each global expert on ``rank``, ``-1`` elsewhere.

    Rank ``r`` holds experts ``[r * L, (r + 1) * L)``, ``L = num_experts // world_size``.
    """
    n_local = num_local_experts_for(num_experts, world_size)
    m = torch.full((num_experts,), -1, dtype=torch.int32, device=device)
    m[rank * n_local:(rank + 1) * n_local] = torch.arange(n_local, dtype=torch.int32, device=device)
    return m


def stand_in_local_ids(topk_ids: torch.Tensor, num_experts: int, world_size: int) -> torch.Tensor:
    """The local expert each (token, expert) pair is computed by on a rank whose own tokens stand
    in for its peers' (the emulated rank, :mod:`dbo.backends.emulated`): a pair routed to global
    expert ``e`` arrives "from" rank ``e // L`` at local expert ``e % L``, ``L = num_experts //
    world_size``; ``-1`` stays ``-1``. A single-process MoE over that rank's ``L`` experts with
    these ids and the same weights is what its layer computes."""
    n_local = num_local_experts_for(num_experts, world_size)
    return torch.where(topk_ids >= 0, torch.remainder(topk_ids, n_local), -1)
