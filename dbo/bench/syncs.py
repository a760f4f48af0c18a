"""Where a step makes the host wait for the GPU: torch's sync debug mode, with the call sites.

A host sync (``.item()``, ``.tolist()``, ``int(t.max())``, ``torch.nonzero``, a device-to-host
copy) stops the host until the GPU has run everything queued before it. Once per step it costs
little; once per layer, or once per ubatch under DBO, the GPU runs dry while the host launches
the next kernels, and the step becomes host-bound. :func:`host_syncs` records every such call
torch reports inside its block, grouped by the Python stack that made it::

    with host_syncs() as found:
        step()
    print(format_sites(found))

Only the calls torch instruments are seen (its sync debug mode); an NCCL wait or an event's
``synchronize`` is not reported.
"""

from __future__ import annotations

import contextlib
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch

__all__ = ["SyncSite", "host_syncs", "no_host_syncs", "format_sites"]

# what torch's sync debug mode warns (c10/cuda/CUDAFunctions.cpp)
_SYNC_MESSAGE = "called a synchronizing CUDA operation"
# frames of these files say nothing about who asked for the sync
_SKIP = ("/warnings.py", "/contextlib.py", "dbo/bench/syncs.py", "/torch/_tensor.py",
         "/torch/overrides.py", "/torch/utils/_contextlib.py")


@dataclass
class SyncSite:
    """One Python stack that synchronized, and how often it did."""
    stack: tuple[str, ...]   # "file:line function", outermost first
    count: int = 0

    def innermost(self, n: int = 3) -> list[str]:
        return list(self.stack[-n:])


def _stack() -> tuple[str, ...]:
    frames = traceback.extract_stack()
    return tuple(f"{f.filename}:{f.lineno} {f.name}" for f in frames
                 if not any(s in f.filename for s in _SKIP))


@contextlib.contextmanager
def host_syncs() -> Iterator[list[SyncSite]]:
    """Record the synchronizing CUDA calls made inside the block.

    Yields a list that is filled, most frequent first, when the block exits. Waits for the GPU
    on entry (so earlier work is not blamed). Without CUDA the list stays empty.
    """
    result: list[SyncSite] = []
    if not torch.cuda.is_available():
        yield result
        return
    torch.cuda.synchronize()
    found: dict[tuple[str, ...], SyncSite] = {}
    prev_mode = torch.cuda.get_sync_debug_mode()

    def show(message, category, filename, lineno, file=None, line=None):  # noqa: ARG001
        if _SYNC_MESSAGE in str(message):  # not the mode's own "prototype feature" warning
            stack = _stack()
            found.setdefault(stack, SyncSite(stack)).count += 1
        else:
            prev_show(message, category, filename, lineno, file, line)

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        prev_show = warnings.showwarning
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield result
        finally:
            torch.cuda.set_sync_debug_mode(prev_mode)
            warnings.showwarning = prev_show
    result.extend(sorted(found.values(), key=lambda site: -site.count))


@contextlib.contextmanager
def no_host_syncs() -> Iterator[None]:
    """Any synchronizing CUDA call inside raises (torch's sync debug mode "error"), for tests
    that must fail at the first sync; :func:`host_syncs` lists them all instead."""
    torch.cuda.synchronize()
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(prev)


def _short(frame: str) -> str:
    path, _, rest = frame.partition(":")
    for root in ("/dbo/", "/backends/", "/examples/", "/transformers/", "/torch/"):
        if root in path:
            path = root.strip("/") + "/" + path.rsplit(root, 1)[1]
            break
    return f"{path}:{rest}"


def format_sites(sites: list[SyncSite], frames: int = 3, limit: int = 8) -> str:
    """One line per site: the count and its innermost ``frames`` frames, innermost first."""
    if not sites:
        return "no synchronizing call seen (torch's sync debug mode)"
    lines = []
    for s in sites[:limit]:
        lines.append(f"{s.count} x " + " <- ".join(_short(f) for f in reversed(s.innermost(frames))))
    if len(sites) > limit:
        lines.append(f"... and {len(sites) - limit} more sites")
    return "\n".join(lines)
