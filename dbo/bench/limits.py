"""The hardware limit of a step, measured on the device of the same run.

A kernel cannot run faster than the larger of its bytes over the memory bandwidth and its flops
over the matrix rate. Both ceilings are measured at the start of each benchmark run, on its own
device, so a ratio to the limit is comparable across machines and runs:

* bandwidth: a large device-to-device copy, counting bytes read plus bytes written;
* matrix rate: a large square bf16 GEMM (8192^3 on CUDA) on random data (zeros run faster).

Both run for milliseconds, before a power cap acts. Optionally (``held_s``) the same GEMM also
runs back to back for seconds: on an H200 (700 W cap) it then holds ~0.83 of the burst rate at a
lower clock, and so does any call long enough to meet the cap. That held rate is reported beside
the limit, for reading the flops-bound rows; the limit itself uses the burst rate.

The routed experts' cost (:func:`experts_cost`) is that of the two grouped GEMMs over the
(token, slot) pairs routed to this rank: flops ``2 * pairs * hidden * 2I + 2 * pairs * I * hidden``;
bytes = the weights of the experts that receive rows (``3 * hidden * I`` elements each) plus each
GEMM's activations read and written once per pair (``[pairs, hidden]`` in and ``[pairs, 2I]`` out
for gate/up, ``[pairs, I]`` in and ``[pairs, hidden]`` out for down). This is the formula of the
issue that set the target (its table's limits are reproduced by it); a kernel that fuses a
gather or the top-k sum into a GEMM moves fewer activation bytes than it counts, and only where
the weights or the flops do not dominate does that matter. A layer's limit (:func:`layer_limit_ms`)
is the sum of its parts' limits (attention stand-in, router, routed experts, shared expert), since
the parts run one after another.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from dbo.bench.timing import median_ms

__all__ = ["DeviceLimits", "measure_device_limits", "experts_cost", "active_experts",
           "layer_limit_ms", "rate_text"]

_PREFIXES = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def rate_text(per_second: float, unit: str) -> str:
    """A rate (or an amount: ``unit="B"``) to three significant figures in the prefix that keeps
    it at least 1:
    ``rate_text(4.25e12, "B/s") == "4.25 TB/s"``, ``rate_text(3.1e10, "FLOP/s") == "31 GFLOP/s"``
    (a CPU's GEMM rate, which ``f"{tflops:.0f} TFLOP/s"`` would print as 0); ``"0 B/s"`` for a
    rate <= 0."""
    if not per_second > 0:
        return f"0 {unit}"
    rounded = float(f"{per_second:.3g}")  # 999.7e9 is 1.00e12: "1 TB/s", not "1e+03 GB/s"
    value, prefix = rounded, ""
    for scale, name in _PREFIXES:
        if rounded >= scale:
            value, prefix = rounded / scale, name
            break
    number = f"{value:.0f}" if value >= 1000 else f"{value:.3g}"  # past the largest prefix
    return f"{number} {prefix}{unit}"


@dataclass(frozen=True)
class DeviceLimits:
    """Measured ceilings: ``copy_gbps`` (GB/s, read + written) and ``gemm_tflops`` (bf16 on
    CUDA, float32 on the CPU)."""

    device: str
    copy_gbps: float
    gemm_tflops: float
    #: the GEMM's rate held for seconds (None: not measured); informative, see the module docstring
    held_gemm_tflops: float | None = None
    #: the GPU's UUID (None on the CPU): two H200s of one kind ran the same experts calls 3% apart
    #: in time over these ceilings (docs/performance.md), so runs say which one they had
    instance: str | None = None

    def time_ms(self, flops: float, num_bytes: float, held: bool = False) -> float:
        """The limit of a kernel that moves ``num_bytes`` and does ``flops``: milliseconds
        (``held``: at the held GEMM rate)."""
        rate = self.held_gemm_tflops if held else self.gemm_tflops
        if rate is None:
            raise ValueError("the held GEMM rate was not measured (measure_device_limits(held_s=...))")
        return max(num_bytes / (self.copy_gbps * 1e9), flops / (rate * 1e12)) * 1e3

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        held = "" if self.held_gemm_tflops is None else \
            f" (the GEMM held for seconds: {rate_text(self.held_gemm_tflops * 1e12, 'FLOP/s')})"
        return (f"limit = max(bytes / {rate_text(self.copy_gbps * 1e9, 'B/s')}, flops / "
                f"{rate_text(self.gemm_tflops * 1e12, 'FLOP/s')}), both measured at the start of this "
                f"run on {self.device}"
                f"{'' if self.instance is None else f' ({self.instance})'}{held}")


def _copy_ms(copy_bytes: int, device: torch.device, reps: int) -> float:
    src = torch.empty(copy_bytes // 2, dtype=torch.bfloat16, device=device).uniform_()
    dst = torch.empty_like(src)
    return median_ms(lambda: dst.copy_(src), steps=reps, device=device)


def _gemm_operands(n: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(0)
    return tuple(torch.randn(n, n, device=device, generator=gen).to(dtype) for _ in range(2))


def _gemm_ms(n: int, dtype: torch.dtype, device: torch.device, reps: int) -> float:
    a, b = _gemm_operands(n, dtype, device)
    return median_ms(lambda: a @ b, steps=reps, device=device)


def _held_gemm_ms(n: int, dtype: torch.dtype, device: torch.device, seconds: float) -> float:
    # the GEMM back to back for `seconds`; the mean of its second half (the clock has settled)
    a, b = _gemm_operands(n, dtype, device)
    ms = median_ms(lambda: a @ b, steps=3, device=device)
    half = max(1, int(seconds / 2 / (ms * 1e-3)))
    for _ in range(half):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(half):
        a @ b
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / half


def measure_device_limits(device: torch.device | str | None = None, *, copy_bytes: int | None = None,
                          gemm_n: int | None = None, reps: int = 10, held_s: float = 0.0) -> DeviceLimits:
    """Measure the copy bandwidth and the GEMM rate of ``device`` (default: the current CUDA
    device, else the CPU). ``copy_bytes``/``gemm_n``: sizes (default 2 GiB and 8192 on CUDA,
    64 MiB and 1024 on the CPU). ``held_s`` > 0 (CUDA): also the GEMM's rate run back to back
    for that many seconds (``DeviceLimits.held_gemm_tflops``), after the burst measurements."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
    device = torch.device(device)
    cuda = device.type == "cuda"
    copy_bytes = copy_bytes or (2 << 30 if cuda else 64 << 20)
    gemm_n = gemm_n or (8192 if cuda else 1024)
    dtype = torch.bfloat16 if cuda else torch.float32
    copy_ms = _copy_ms(copy_bytes, device, reps)
    gemm_ms = _gemm_ms(gemm_n, dtype, device, reps)
    held_ms = _held_gemm_ms(gemm_n, dtype, device, held_s) if held_s > 0 and cuda else None
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None) if cuda else None

    def tflops(ms: float) -> float:
        return 2 * gemm_n ** 3 / (ms * 1e-3) / 1e12
    return DeviceLimits(device=name, copy_gbps=2 * copy_bytes / (copy_ms * 1e-3) / 1e9,
                        gemm_tflops=tflops(gemm_ms),
                        held_gemm_tflops=None if held_ms is None else tflops(held_ms),
                        instance=None if uuid is None else f"GPU-{uuid}")


def active_experts(local_experts: int, local_pairs: float) -> float:
    """Expected number of local experts that receive at least one of ``local_pairs`` pairs
    spread uniformly (the exact count when the caller has the counts is better)."""
    if local_experts <= 0 or local_pairs <= 0:
        return 0.0
    return local_experts * (1.0 - (1.0 - 1.0 / local_experts) ** local_pairs)


def experts_cost(*, hidden: int, intermediate: int, local_pairs: int, experts_with_rows: float,
                 dtype_bytes: int = 2) -> tuple[float, float]:
    """``(flops, bytes)`` of the routed experts of one rank (see the module docstring).

    Args:
        local_pairs: (token, slot) pairs routed to this rank's experts.
        experts_with_rows: local experts that receive at least one pair (their weights are read).
    """
    flops = 6.0 * local_pairs * hidden * intermediate
    weights = experts_with_rows * 3.0 * hidden * intermediate * dtype_bytes
    acts = local_pairs * (2.0 * hidden + 3.0 * intermediate) * dtype_bytes
    return flops, weights + acts


def layer_limit_ms(limits: DeviceLimits, *, tokens: int, hidden: int, intermediate: int,
                   shared_intermediate: int, num_experts: int, topk: int, attn_width: int,
                   world_size: int, dtype_bytes: int = 2) -> dict[str, float]:
    """The limit of one layer of :class:`dbo.bench.overlap.model.BenchModel` per part and in total
    (``"total"``), in ms, for ``tokens`` rows on this rank and uniform routing."""
    act = tokens * hidden * dtype_bytes
    local = num_experts // world_size
    pairs = tokens * topk * world_size * local / num_experts  # every rank sends as many
    parts = {
        "attention": limits.time_ms(4.0 * tokens * hidden * attn_width,
                                    2 * hidden * attn_width * dtype_bytes + 2 * act),
        "router": limits.time_ms(2.0 * tokens * hidden * num_experts,
                                 num_experts * hidden * dtype_bytes + act),
        "routed_experts": limits.time_ms(*experts_cost(
            hidden=hidden, intermediate=intermediate, local_pairs=int(pairs),
            experts_with_rows=active_experts(local, pairs), dtype_bytes=dtype_bytes)),
        "shared_expert": limits.time_ms(6.0 * tokens * hidden * shared_intermediate,
                                        3 * hidden * shared_intermediate * dtype_bytes + 2 * act),
    }
    parts["total"] = sum(parts.values())
    return parts
