"""A split batch's rows: each ubatch's inputs cut from the batch and padded, and the ubatches'
outputs concatenated back without the padding. Pure functions of a :class:`UBatchPlan`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from dbo.split.types import UBatchPlan

__all__ = ["check_token_major", "split_inputs", "merge_outputs"]


def check_token_major(tensors: Sequence[torch.Tensor]) -> int:
    """The number of rows of ``tensors``, which must be token-major ``[num_tokens, ...]``
    tensors with the same number of rows (ValueError/TypeError otherwise)."""
    if not tensors:
        raise ValueError("overlapped_forward needs at least one token-major tensor")
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensors[{i}] must be a torch.Tensor, got {type(t).__name__} "
                            "(pass other arguments through fn_kwargs)")
        if t.dim() == 0:
            raise ValueError(f"tensors[{i}] is a scalar; inputs must be token-major [num_tokens, ...]")
    num_tokens = tensors[0].shape[0]
    for i, t in enumerate(tensors):
        if t.shape[0] != num_tokens:
            raise ValueError(f"tensors[{i}] has {t.shape[0]} rows, tensors[0] has {num_tokens}: "
                             "inputs must be token-major with the same number of tokens")
    return num_tokens


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    if rows == 0:
        return x
    return torch.cat([x, x.new_zeros((rows, *x.shape[1:]))])


def split_inputs(plan: UBatchPlan, tensors: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, ...]]:
    """Each ubatch's inputs: rows ``plan.slices[i]`` of every tensor, padded with zero rows to
    ``plan.padded_size``. An unpadded ubatch gets views of the inputs."""
    out = []
    for i, (start, stop) in enumerate(plan.slices):
        pad = plan.num_padding(i)
        out.append(tuple(_pad_rows(t[start:stop], pad) for t in tensors))
    return out


def merge_outputs(plan: UBatchPlan, outputs: Sequence[Any]) -> Any:
    """Concatenate the ubatches' outputs in order, dropping padding rows.

    Every output must have the same structure: a tensor ``[padded_size, ...]``, or a
    tuple/list/dict of them (nested), or None.
    """
    first = outputs[0]
    if first is None:
        if any(o is not None for o in outputs):
            raise TypeError("ubatch outputs differ in structure: some are None")
        return None
    if isinstance(first, torch.Tensor):
        parts = []
        for i, o in enumerate(outputs):
            if not isinstance(o, torch.Tensor) or o.dim() == 0 or o.shape[0] != plan.padded_size:
                shape = tuple(o.shape) if isinstance(o, torch.Tensor) else type(o).__name__
                raise TypeError(f"ubatch {i} output {shape} is not token-major with "
                                f"{plan.padded_size} rows")
            parts.append(o[: plan.num_valid(i)])
        return torch.cat(parts)
    if isinstance(first, (tuple, list)):
        if any(not isinstance(o, type(first)) or len(o) != len(first) for o in outputs):
            raise TypeError("ubatch outputs differ in structure")
        merged = [merge_outputs(plan, [o[k] for o in outputs]) for k in range(len(first))]
        return type(first)(merged) if isinstance(first, list) or not hasattr(first, "_fields") \
            else type(first)(*merged)
    if isinstance(first, Mapping):
        if any(not isinstance(o, Mapping) or o.keys() != first.keys() for o in outputs):
            raise TypeError("ubatch outputs differ in structure")
        return {k: merge_outputs(plan, [o[k] for o in outputs]) for k in first}
    raise TypeError(f"cannot merge ubatch outputs of type {type(first).__name__}: return "
                    "token-major tensors (or tuples/lists/dicts of them)")
