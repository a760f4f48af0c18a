"""Fused SwiGLU experts for CUDA (Triton): three kernels between the routing and the output.

``out[m] = sum over local slots s of w[m, s] * (silu(x[m] @ g_e.T) * (x[m] @ u_e.T)) @ d_e.T``
with ``e = topk_ids[m, s]``, ``[g_e; u_e] = w1[e]`` and ``d_e = w2[e]``.

1. The (token, slot) pairs are sorted by local expert on the device: where the chunks'
   histogram fits (:func:`dbo.experts.kernels.fused_route.uses_counting_sort`) a counting sort in two
   Triton launches (a histogram per chunk, then each pair's place), above it one 16-bit radix
   sort and a ``searchsorted`` for each expert's end row. Nothing is read back.
2. ``gate_up``: a grouped GEMM whose prologue gathers each row's token from ``x`` (no gathered
   copy of the activations) and whose epilogue applies ``silu(gate) * up`` (no ``[R, 2I]``
   intermediate): it computes the gate and up tiles of the same columns side by side. From ~96
   rows per expert on Hopper, a warp-specialized Gluon kernel (:mod:`dbo.experts.kernels.gluon_gate_up`,
   ``GemmConfig.ws``) computes the same numbers (split along K in its last round: in another
   float32 order).
3. ``down``: a grouped GEMM whose epilogue writes each row to its slot's place, ``y[m * topk +
   s]`` (``[M * topk, hidden]``, slots of other ranks' experts left unwritten).
4. ``topk_sum``: ``out[m] = sum_s w[m, s] * y[m * topk + s]`` over the local slots, float32
   accumulation, contiguous reads, no atomics (the sum's order is fixed: run to run the same).
   Where few slots are local (``sole_pairs``), the flat down kernel writes the row of a token's
   only local slot to ``out[m]`` itself, weighted with the sum's rounding, and the sum skips that
   token: its row is neither written to ``y`` nor read back.

A program finds its expert and its tile from the device offsets itself (a scan over at most
``BLOCK_E`` experts), so the grid is an upper bound known on the host: programs past the last
expert's tiles do nothing. The flat down kernel, whose tiles are short (a few K steps at I <=
768), and the Gluon gate/up kernel read their row tiles from a map instead (five scalar loads
per tile where the scan costs five block-wide reductions), built with the sole rows' marks by
the counting sort's second launch (:func:`dbo.experts.kernels.fused_route.route_with_maps`; after the radix
sort, or without routing, one launch of :func:`dbo.experts.kernels.fused_maps.tile_maps`).
Where that bound counts many more tiles than there are (without
host counts, a small local share of the experts: at 32 of 256 local experts 7 of 8 programs
had nothing to do) the GEMMs run persistent instead: one program per resident slot of the GPU,
each walking every num_programs-th tile (:func:`dbo.experts.kernels.fused_tiles.prefer_persistent` says
where that pays). Within an expert the tiles are visited in groups of ``group_m`` row blocks
per column block, so that concurrent programs share weight tiles in L2 (the maps' groups are
as equal as can be and never span two experts; the K-loop kernels' take ``group_m`` at a time).

Both GEMMs' tiles are ``BLOCK_M`` rows of one expert; an expert's last tile, when its rows fit,
runs as a smaller tile (``GemmConfig.tail_m``, or half of ``BLOCK_M``), so the rows past the
expert's end cost no flops (at 128 rows per expert a 128-row tile computed 1.5x the rows).
Tile sizes come from :mod:`dbo.experts.kernels.fused_tiles` (per bucket of rows per expert, intermediate
size and local experts, measured on an H200: see docs/performance.md); ``configs=`` overrides.
"""

from __future__ import annotations

import torch

from dbo.experts.kernels import gluon_gate_up
from dbo.experts.kernels.fused_maps import block_e, tile_map, tile_maps
from dbo.experts.kernels.fused_route import route_order, route_with_maps
from dbo.experts.kernels.fused_tiles import (
    CONFIGS,
    DOWN_TAIL,
    FP32_CONFIG,
    FUSED_MAX_ROWS_PER_EXPERT,
    GemmConfig,
    pick_configs,
    prefer_fused,
    prefer_persistent,
    prefer_sole,
)
from dbo.experts.kernels.gather_reduce import row_block
from dbo.kernels.triton_launch import Desc, cdiv, launch, next_pow2

__all__ = ["GemmConfig", "CONFIGS", "FP32_CONFIG", "FUSED_MAX_ROWS_PER_EXPERT", "prefer_fused",
           "pick_configs", "fused_swiglu_experts", "route_order", "launch_gate_up", "launch_down",
           "launch_topk_sum", "tile_map", "tile_maps", "route_with_maps", "ws_programs", "runs_ws",
           "runs_flat", "resident_sms", "persistent_grid"]

try:
    import triton
except ImportError:  # the module is only used where Triton is importable
    triton = None
else:
    from dbo.experts.kernels.fused_kernels import (
        down_flat_kernel,
        down_kernel,
        down_short_k_kernel,
        gate_up_kernel,
        topk_sum_kernel,
    )


def _bound(cfg: GemmConfig, pairs: int, n_experts: int, cols: int) -> int:
    # tiles: sum over experts of ceil(rows_e / BLOCK_M) <= pairs / BLOCK_M + E, times column blocks
    return (cdiv(pairs, cfg.block_m) + n_experts) * cdiv(cols, cfg.block_n)


#: (kernel, its compile-time arguments, device) -> programs that fit on one SM at once
_PER_SM: dict[tuple, int] = {}
#: programs of the persistent kernels without a GPU (Triton's interpreter): a few, so that each
#: program walks several tiles
INTERPRETER_PROGRAMS = 3


def _per_sm(compiled, props) -> int:
    """Programs of a compiled kernel resident on one SM: the tightest of its shared memory,
    registers (allocated per warp in units of 256) and warps."""
    try:
        warps = compiled.metadata.num_warps
        smem = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
        fit = [smem // (compiled.metadata.shared + 1024), 64 // warps]
        regs = getattr(compiled, "n_regs", 0)
        if regs:
            per_warp = -(-regs * 32 // 256) * 256
            fit.append(getattr(props, "regs_per_multiprocessor", 65536) // (warps * per_warp))
        return max(1, min(fit))
    except AttributeError:  # another Triton's CompiledKernel: one per SM is always right
        return 1


def _launch(kernel, bound: int, device: torch.device, args: tuple, kwargs: dict, persistent: bool,
            sm_carveout: int | None) -> None:
    """Launch a grouped GEMM kernel: one program per tile of the host's ``bound`` (those past
    the device's tiles do nothing), or ``persistent``: :func:`persistent_grid` programs, each
    walking every num_programs-th tile, so that none is spent on the tiles past the local pairs
    that the bound counts, and ``sm_carveout`` SMs stay free. ``kwargs`` carry the kernel's
    ``PERSISTENT`` where it has one (the flat down kernel is persistent always)."""
    if not persistent:
        launch(kernel, (bound,), args, kwargs)
    elif device.type != "cuda":  # Triton's interpreter
        launch(kernel, (max(1, min(bound, INTERPRETER_PROGRAMS)),), args, kwargs)
    else:
        # the activations' dtype (the first tensor argument, or the first descriptor's tensor);
        # id(kernel): a JITFunction hashes through its source's cache key
        dtype = next(a.tensor.dtype if type(a) is Desc else a.dtype for a in args
                     if type(a) is Desc or isinstance(a, torch.Tensor))
        key = (id(kernel), tuple(kwargs.items()), dtype, device)
        props = _props(device)
        per_sm = _PER_SM.get(key)
        compiled = launch(kernel, (persistent_grid(bound, props, per_sm or 1, sm_carveout),), args,
                          kwargs)
        if per_sm is None:
            _PER_SM[key] = _per_sm(compiled, props)


_PROPS: dict[torch.device, object] = {}


def resident_sms(props, sm_carveout: int | None) -> int:
    """The SMs a persistent kernel's programs spread over: the device's
    (``props.multi_processor_count``) less ``sm_carveout`` (None or 0: all of them; at least
    one). A persistent grid that fills every SM keeps each SM until its last tile is done, so a
    kernel queued meanwhile on another stream (a DeepEP kernel of the other ubatch) cannot start
    before it ends; the carve-out leaves it room, as torch's carve-out does for cuBLAS
    (:func:`dbo.ubatch.sm.sm_carveout`). The caller passes the number: ``SwiGLUExperts``'s
    ``sm_carveout``, which the overlapped forward sets for its runs."""
    total = props.multi_processor_count
    return max(1, total - sm_carveout) if sm_carveout else total


def persistent_grid(bound: int, props, per_sm: int, sm_carveout: int | None) -> int:
    """Programs of a persistent launch: ``per_sm`` resident programs on each of
    :func:`resident_sms` SMs, no more than the ``bound`` tiles, at least one."""
    return max(1, min(bound, resident_sms(props, sm_carveout) * per_sm))


def _props(device: torch.device):
    if device not in _PROPS:
        _PROPS[device] = torch.cuda.get_device_properties(device)
    return _PROPS[device]


def _tma_ok(t: torch.Tensor) -> bool:
    """Whether ``t``'s device has the tensor memory accelerator the TMA tiles load through
    (sm_90 on; Triton's interpreter emulates it)."""
    return not t.is_cuda or _props(t.device).major >= 9


def _aligned(*tensors: torch.Tensor) -> bool:
    # a TMA descriptor's base must be 16-byte aligned (a weight tensor may be a view)
    return all(t.data_ptr() % 16 == 0 for t in tensors)


def _precision(x: torch.Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"


def runs_ws(cfg: GemmConfig, x: torch.Tensor, w1: torch.Tensor) -> bool:
    """Whether the gate/up tile ``cfg`` runs as the warp-specialized Gluon kernel for these
    operands (else as the Triton kernel)."""
    return cfg.ws and gluon_gate_up.available(x, w1, cfg.block_n) and _props(x.device).major == 9


def ws_programs(cfg: GemmConfig, pairs: int, w1: torch.Tensor, sm_carveout: int | None = None) -> int:
    """The programs of the warp-specialized gate/up kernel for tile ``cfg`` (one per SM at most,
    ``sm_carveout`` SMs left free); a split tile's kernel takes as many int32 counters
    (:func:`launch_gate_up`'s ``counts``, sized with the same ``sm_carveout``)."""
    n_experts, two_inter, _ = w1.shape
    return min(_bound(cfg, pairs, n_experts, two_inter // 2),
               resident_sms(_props(w1.device), sm_carveout))


def launch_gate_up(x: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor, w1: torch.Tensor,
                   act: torch.Tensor, cfg: GemmConfig, pairs: int, topk: int,
                   persistent: bool = False, tiles: torch.Tensor | None = None,
                   counts: torch.Tensor | None = None, sm_carveout: int | None = None) -> None:
    """``act[r] = silu(x[t] @ g_e.T) * (x[t] @ u_e.T)`` for each sorted row ``r`` of expert
    ``e`` (``t = order[r] // topk``); ``pairs``: an upper bound of the local pairs (the grid).
    ``tiles``: the row-tile map of a warp-specialized tile (:func:`tile_map` with its
    ``block_m``), where the caller built it already; ``counts``: a split tile's zeroed counters
    (:func:`ws_programs` of them, e.g. zeroed by :func:`tile_maps`), else allocated here.
    ``sm_carveout``: SMs a persistent grid leaves free (:func:`resident_sms`)."""
    n_experts, two_inter, hidden = w1.shape
    inter = two_inter // 2
    if runs_ws(cfg, x, w1):
        if tiles is None:
            tiles, _ = tile_map(offsets, cfg.block_m, pairs, group_m=cfg.group_m)
        gluon_gate_up.launch_gate_up_ws(x, order, tiles, w1, act, topk,
                                        ws_programs(cfg, pairs, w1, sm_carveout),
                                        block_m=cfg.block_m, block_n=cfg.block_n, block_k=cfg.block_k,
                                        stages=cfg.num_stages, split=cfg.split, counts=counts)
        return
    # a ws tile here (not on a Hopper GPU, or operands it cannot take): its Triton tile
    cfg = FP32_CONFIG if x.element_size() > 2 else cfg.triton_tile()
    persistent = cfg.runs_persistent(persistent)
    tma = cfg.tma and _tma_ok(x) and hidden % cfg.block_k == 0 and _aligned(w1)
    w = Desc(w1.view(n_experts * two_inter, hidden), (cfg.block_n, cfg.block_k)) if tma else w1
    _launch(gate_up_kernel, _bound(cfg, pairs, n_experts, inter), x.device, (
        x, order, offsets, w, act, n_experts, hidden, inter, w1.stride(0)), dict(
        TOPK=topk, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        BLOCK_E=block_e(n_experts), GROUP_M=cfg.group_m, TAIL_M=cfg.tail_m,
        EVEN_K=hidden % cfg.block_k == 0, PRECISION=_precision(x), TMA=tma, PERSISTENT=persistent,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages), persistent, sm_carveout)


def runs_flat(cfg: GemmConfig, act: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether the down tile ``cfg`` runs as the flat kernel for these operands (TMA needs
    sm_90 or newer, 16-byte rows and bases; else the K-loop tile)."""
    return cfg.flat and _tma_ok(act) and w2.shape[2] % 8 == 0 and _aligned(act, w2)


def launch_down(act: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor, w2: torch.Tensor,
                y: torch.Tensor, cfg: GemmConfig, pairs: int, persistent: bool = False,
                sole: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                tile_maps: tuple[torch.Tensor, torch.Tensor | None] | None = None,
                sm_carveout: int | None = None) -> bool:
    """``y[order[r]] = act[r] @ d_e.T`` for each sorted row ``r`` of expert ``e``.

    ``sole``: ``(topk_ids, topk_weights, out)``: where the tile is the flat one, a row whose
    token has no other local slot is written weighted to ``out`` instead (the top-k sum then
    leaves that token alone: :func:`launch_topk_sum` with ``sole=True``). Returns whether it
    was (other tiles write every row to ``y``). ``tile_maps``: the flat tile's map and marks,
    where the caller built them already (:func:`tile_map` with this tile's ``block_m``, and
    ``sole=(order, topk_ids)`` exactly when ``sole`` is given). ``sm_carveout``: SMs a
    persistent grid leaves free (:func:`resident_sms`)."""
    n_experts, hidden, inter = w2.shape
    cfg = FP32_CONFIG if act.element_size() > 2 else cfg
    persistent = cfg.runs_persistent(persistent)
    if cfg.n_per_program:
        if next_pow2(inter) > cfg.block_k:
            raise ValueError(f"a short-K tile needs block_k >= intermediate ({inter}), got {cfg.block_k}")
        groups = cdiv(cdiv(hidden, cfg.block_n), cfg.n_per_program)
        _launch(down_short_k_kernel, (cdiv(pairs, cfg.block_m) + n_experts) * groups,
                           act.device, (act, order, offsets, w2, y, n_experts, hidden, inter, w2.stride(0)),
                           dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                                N_PER_PROGRAM=cfg.n_per_program, BLOCK_E=block_e(n_experts),
                                GROUP_M=cfg.group_m, PRECISION=_precision(act), PERSISTENT=persistent,
                                num_warps=cfg.num_warps, num_stages=cfg.num_stages), persistent,
                           sm_carveout)
        return False
    flat = runs_flat(cfg, act, w2)
    if cfg.flat and not flat:
        cfg = DOWN_TAIL  # TMA needs 16-byte rows and bases: the K-loop tile reads through pointers
    tma = flat or (cfg.tma and _tma_ok(act) and inter % cfg.block_k == 0 and _aligned(act, w2))
    a_desc, w = act, w2
    if tma:
        a_desc = Desc(act, (cfg.block_m, cfg.block_k))
        w = Desc(w2.view(n_experts * hidden, inter), (cfg.block_n, cfg.block_k))
    if flat:
        if tile_maps is None:
            tile_maps = tile_map(offsets, cfg.block_m, pairs, None if sole is None else (order, sole[0]),
                                 cfg.group_m)
        elif (tile_maps[1] is None) != (sole is None):
            raise ValueError("tile_maps must carry the sole rows' marks exactly when sole is given")
        tiles, dest = tile_maps
        # without sole the weights and the output are not read: y and order stand in for them
        tw, out, topk = (sole[1], sole[2], sole[0].shape[1]) if sole is not None else (order, y, 1)
        _launch(down_flat_kernel, _bound(cfg, pairs, n_experts, hidden), act.device, (
            a_desc, order if dest is None else dest, tiles, w, y, tw, out, hidden, inter), dict(
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            TOPK=topk, SOLE=sole is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages), True,
            sm_carveout)
        return sole is not None
    _launch(down_kernel, _bound(cfg, pairs, n_experts, hidden), act.device, (
        act, a_desc, order, offsets, w, y, n_experts, hidden, inter, w2.stride(0)), dict(
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_E=block_e(n_experts),
        GROUP_M=cfg.group_m, TAIL_M=cfg.tail_m, EVEN_K=inter % cfg.block_k == 0,
        PRECISION=_precision(act), TMA=tma, PERSISTENT=persistent, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages), persistent, sm_carveout)
    return False


def fused_swiglu_experts(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                         topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                         out: torch.Tensor, reduce: bool = True, max_local_pairs: int | None = None,
                         configs: tuple[GemmConfig, GemmConfig] | None = None,
                         bounds: torch.Tensor | None = None,
                         rows_per_expert: float | None = None,
                         persistent: bool | None = None, sole_pairs: bool | None = None,
                         sm_carveout: int | None = None) -> torch.Tensor:
    """Routed SwiGLU experts, fused (see the module docstring). CUDA tensors, Triton.

    Args:
        x: ``[M, hidden]`` bf16/fp16/float32 tokens.
        w1: ``[E, 2I, hidden]`` gate rows first, ``x``'s dtype. w2: ``[E, hidden, I]``.
        topk_weights: ``[M, topk]`` float (router weights; ones for weights applied on input).
        topk_ids: ``[M, topk]`` int32/int64 local expert ids, ``-1`` for other ranks' experts.
        out: ``[M, hidden]`` (``reduce``) or ``[M, topk, hidden]`` (not ``reduce``: each slot's
            unweighted output, zeros for other ranks' slots), ``x``'s dtype.
        max_local_pairs: an upper bound of the local pairs if the host knows one (DeepEP's host
            counts): it sizes the grid and picks the tiles; default ``M * topk``.
        configs: ``(gate_up, down)`` tiles; default :func:`pick_configs`.
        bounds: cached ``arange(1, E + 1)`` int16 on the device (see :func:`route_order`).
        rows_per_expert: the caller's estimate, for the tiles (default ``max_local_pairs / E``).
        persistent: the GEMMs' programs walk the tiles (see :func:`prefer_persistent`, the
            default on CUDA) rather than one program per tile of the host's bound; a tile whose
            ``GemmConfig.persistent`` is set keeps its own.
        sole_pairs: ``reduce`` with the flat down tile: a token's row with no other local slot
            goes weighted from the down GEMM to ``out``, skipping ``y`` and the top-k sum (the
            same numbers). Default :func:`prefer_sole`, from the local share of the slots.
        sm_carveout: SMs the persistent grids leave free for kernels on other streams (the
            other ubatch's communication); None or 0: they spread over every SM. The caller
            checked it (``SwiGLUExperts(sm_carveout=...)``).

    Returns:
        ``out``. Nothing waits for the GPU.
    """
    m, hidden = x.shape
    n_experts, two_inter, _ = w1.shape
    inter = two_inter // 2
    topk = topk_ids.shape[1]
    x, w1, w2 = x.contiguous(), w1.contiguous(), w2.contiguous()
    pairs = m * topk if max_local_pairs is None else min(max_local_pairs, m * topk)
    est = pairs / n_experts if rows_per_expert is None else rows_per_expert
    up_cfg, down_cfg = pick_configs(est, inter, n_experts) if configs is None else configs
    if persistent is None:
        persistent = prefer_persistent(est, pairs, n_experts) if x.is_cuda else True
    act = torch.empty(m * topk, inter, dtype=x.dtype, device=x.device)
    if reduce and sole_pairs is None:
        sole_pairs = prefer_sole(est * n_experts / max(1, m * topk), topk)
    ids, tw = topk_ids.contiguous(), topk_weights.contiguous()
    sole_args = (ids, tw, out) if reduce and sole_pairs else None
    up_map = down_maps = counts = None
    if runs_ws(up_cfg, x, w1) and runs_flat(down_cfg, act, w2):
        # both GEMMs' maps, the sole rows' marks and the split's counters with the routing
        if up_cfg.split > 1:
            counts = torch.empty(ws_programs(up_cfg, pairs, w1, sm_carveout), dtype=torch.int32,
                                 device=x.device)
        # one map where both tiles' rows and groups are equal
        shapes = tuple(dict.fromkeys(((up_cfg.block_m, up_cfg.group_m),
                                      (down_cfg.block_m, down_cfg.group_m))))
        order, offsets, maps, dest = route_with_maps(ids, n_experts, tuple(h for h, _ in shapes), pairs,
                                                     sole_args is not None, counts, bounds,
                                                     tuple(g for _, g in shapes))
        up_map, down_maps = maps[0], (maps[-1], dest)
    else:
        order, offsets = route_order(ids, n_experts, bounds)
    launch_gate_up(x, order, offsets, w1, act, up_cfg, pairs, topk, persistent, up_map, counts,
                   sm_carveout=sm_carveout)
    y = out.view(m * topk, hidden) if not reduce else \
        torch.empty(m * topk, hidden, dtype=x.dtype, device=x.device)
    sole = launch_down(act, order, offsets, w2, y, down_cfg, pairs, persistent, sole_args, down_maps,
                       sm_carveout=sm_carveout)
    if not reduce:
        local = (topk_ids >= 0) & (topk_ids < n_experts)
        return out.masked_fill_(~local.unsqueeze(-1), 0)
    launch_topk_sum(y, ids, tw, out, n_experts, sole)
    return out


#: columns of one token per program of the top-k sum: its slots are a chain of dependent loads
#: (the ids, then each local slot's row behind a branch), so fewer, wider programs wait less.
#: On an H200 (``tests/gpu/probe_topk_sum.py`` at 88cef6a), against 1024: 0.90-0.94x the kernel's time
#: with 32 of 256 experts local from 16384 tokens, 0.99-1.01x with every expert local (there
#: at the copy bandwidth either way); 8-16 warps or 4096-8192 columns did no better
TOPK_SUM_BLOCK = 2048


def launch_topk_sum(y: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                    out: torch.Tensor, n_experts: int, sole: bool = False, *, block: int | None = None,
                    num_warps: int = 4) -> None:
    """``out[m] = sum_s w[m, s] * y[m * topk + s]`` over the slots of local experts (``sole``:
    not for the tokens with one local slot, whose row :func:`launch_down` wrote). A program
    sums ``block`` columns of one token (default :data:`TOPK_SUM_BLOCK`, or the row's power of
    two where it is narrower) with ``num_warps`` warps."""
    m, topk = topk_ids.shape
    hidden = y.shape[1]
    block = row_block(hidden, TOPK_SUM_BLOCK) if block is None else block
    if block < 16 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 16, got {block}")
    launch(topk_sum_kernel, (m, cdiv(hidden, block)), (
        y, topk_ids.contiguous(), topk_weights.contiguous(), out, n_experts, hidden), dict(TOPK=topk,
        BLOCK=block, SOLE=sole, num_warps=num_warps))
