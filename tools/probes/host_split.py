"""Where the host's time of an eager step goes, without torch's profiler: its own time (launches,
Python, torch's dispatch) against its waits on the GPU.

    python tools/probes/host_split.py [--profile-every 4] [--top 40] [--out DIR] -- \
        --device cuda --emulate-ep 32 --emulate-layout deepep_ht --link deepep-ib-ht --layers 8 \
        --attn-width 1024 --tokens 4096 --intermediate 2048 --modes serial dbo --steps 20 \
        --no-autotune --profile-shape none

Runs ``dbo.bench overlap`` (its arguments after ``--``, as plain ``python``) and times every
serial, split (``dbo``) and merged step on the host: its wall time from call to return (the step
does not wait for its GPU work at the end) and, inside it, the time spent blocked on the GPU
(``Event.synchronize``, ``Stream.synchronize``, ``torch.cuda.synchronize``, and ``item`` /
``tolist`` / ``cpu`` of a CUDA tensor: DeepEP normal mode's wait for the received counts is one).
The host's own time is the rest (``gc``: the part of it in Python's garbage collector). torch's
profiler records every op and inflates that part; this costs two ``perf_counter`` calls a wait.
Every ``--profile-every``-th step of each mode runs under cProfile instead (left out of the
times), and the functions with the most own time are printed per mode (``DIR/<mode>.prof`` for
``python -m pstats``). ``--find-syncs K`` runs the K-th step of each mode under torch's sync
debug mode (also left out) and prints the call sites that made the host wait, the implicit ones
(``nonzero``, a boolean index) included, which the timing above counts as own time.

``--tree DIR`` times another revision's ``dbo`` against this one's, e.g. before and after a change:

    mkdir -p /tmp/old && git archive REV dbo backends | tar -x -C /tmp/old
    mv /tmp/old/backends /tmp/old/dbo/
    python tools/probes/host_split.py --tree /tmp/old -- ...

``dbo`` (and ``dbo.backends``) are then imported from DIR, past an editable install's finder,
which would otherwise map ``dbo.backends`` to this checkout's ``backends/``. The first line printed
says where both came from.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

_WAIT = [0.0]  # seconds blocked on the GPU inside the current timed step
_IN_STEP = [False]
_GC = [0.0, 0.0]  # seconds in Python's garbage collector inside the current step; its last start


def _gc_callback(phase: str, info: dict) -> None:  # noqa: ARG001
    if not _IN_STEP[0]:
        return
    if phase == "start":
        _GC[1] = time.perf_counter()
    else:
        _GC[0] += time.perf_counter() - _GC[1]


def _timed(fn, cuda_only: bool = False):
    def wrapper(*args, **kwargs):
        if not _IN_STEP[0] or (cuda_only and not (args and getattr(args[0], "is_cuda", False))):
            return fn(*args, **kwargs)
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _WAIT[0] += time.perf_counter() - t0
    wrapper.__wrapped__ = fn
    return wrapper


def _patch_waits() -> None:
    torch.cuda.Event.synchronize = _timed(torch.cuda.Event.synchronize)
    torch.cuda.Stream.synchronize = _timed(torch.cuda.Stream.synchronize)
    torch.cuda.synchronize = _timed(torch.cuda.synchronize)
    for name in ("item", "tolist", "cpu"):
        setattr(torch.Tensor, name, _timed(getattr(torch.Tensor, name), cuda_only=True))


def _use_tree(tree: Path) -> None:
    """Import ``dbo`` from ``tree`` rather than from the installed checkout."""
    if not (tree / "dbo" / "backends" / "__init__.py").is_file():
        raise SystemExit(f"host_split.py --tree {tree}: want {tree}/dbo/backends/__init__.py (the "
                         "revision's backends/ moved into its dbo/)")
    if "dbo" in sys.modules:
        raise SystemExit("host_split.py --tree: dbo was imported before the tree could be put first")
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__.lower()]
    here = Path(__file__).resolve().parents[2]  # this checkout: not on the path, or its dbo wins
    sys.path[:] = [str(tree.resolve())] + [q for q in sys.path
                                           if Path(q or ".").resolve() != here]


def main() -> int:
    argv = sys.argv[1:]
    bench_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile-every", type=int, default=4, help="cProfile every N-th step of a mode "
                   "(0: none)")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--sort", nargs="+", default=["tottime", "cumulative"], choices=["tottime", "cumulative"],
                   help="the profiled functions' listings, each by this key (cumulative: dbo's own "
                        "functions only, what each call path costs with everything under it)")
    p.add_argument("--find-syncs", type=int, default=0, metavar="K",
                   help="on CUDA, the K-th step of each mode runs under torch's sync debug mode (left out "
                        "of the times) and the sites that made the host wait are printed (0: none)")
    p.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "host_split"),
                   help="where the profiles go (DIR/<mode>.prof; default: the system's temporary folder)")
    p.add_argument("--tree", default=None, help="import dbo from this directory (DIR/dbo, with "
                   "dbo/backends in it): another revision to time")
    a = p.parse_args(own)
    if a.tree is not None:
        _use_tree(Path(a.tree))
    import dbo
    import dbo.backends

    print(f"host_split: dbo from {Path(dbo.__file__).parent}, dbo.backends from "
          f"{Path(dbo.backends.__file__).parent}")
    _patch_waits()
    gc.callbacks.append(_gc_callback)
    from dbo.bench.overlap.command import main as bench_main
    from dbo.bench.overlap.shape import ShapeBench
    from dbo.bench.syncs import format_sites, host_syncs

    layers = {"n": 1}
    times: dict[tuple[int, str], list[tuple[float, float, float]]] = defaultdict(list)  # wall, waits, gc
    calls: dict[tuple[int, str], int] = defaultdict(int)
    profs: dict[str, cProfile.Profile] = {}
    syncs: dict[tuple[int, str], list] = {}

    def wrap(mode: str):
        step = getattr(ShapeBench, mode)

        def timed(self, *args, **kwargs):
            layers["n"] = self.layers
            key = (self.T, mode if mode != "dbo" or self.carveout is None else f"dbo k{self.carveout}")
            calls[key] += 1
            if a.find_syncs and calls[key] == a.find_syncs:
                with host_syncs() as found:
                    result = step(self, *args, **kwargs)
                syncs[key] = found
                return result
            if a.profile_every and calls[key] % a.profile_every == 0:
                prof = profs.setdefault(mode, cProfile.Profile())
                prof.enable()
                try:
                    return step(self, *args, **kwargs)
                finally:
                    prof.disable()
            _WAIT[0] = _GC[0] = 0.0
            _IN_STEP[0] = True
            t0 = time.perf_counter()
            try:
                return step(self, *args, **kwargs)
            finally:
                wall = time.perf_counter() - t0
                _IN_STEP[0] = False
                times[key].append((wall, _WAIT[0], _GC[0]))
        return timed

    for mode in ("serial", "dbo", "merged"):
        setattr(ShapeBench, mode, wrap(mode))
    rc = bench_main(bench_args)
    n = layers["n"]
    print(f"\nhost time per layer (ms), median over the unprofiled steps; own = wall - waits "
          f"({n} layers a step)")
    print(f"{'T':>6} {'mode':<10} {'steps':>5} {'wall':>8} {'waits':>8} {'own':>8} {'gc':>8}")
    for (t, mode), rows in sorted(times.items()):
        rows = rows[2:] or rows  # the first steps warm the allocator and the kernels' caches
        wall = statistics.median(r[0] for r in rows) * 1e3 / n
        wait = statistics.median(r[1] for r in rows) * 1e3 / n
        own = statistics.median(r[0] - r[1] for r in rows) * 1e3 / n
        in_gc = statistics.median(r[2] for r in rows) * 1e3 / n
        print(f"{t:>6} {mode:<10} {len(rows):>5} {wall:>8.3f} {wait:>8.3f} {own:>8.3f} {in_gc:>8.3f}")
    for (t, mode), found in sorted(syncs.items()):
        print(f"\nhost syncs in one {mode} step at T={t} ({n} layers): "
              f"{sum(site.count for site in found)}\n{format_sites(found)}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for mode, prof in profs.items():
        prof.dump_stats(str(out / f"{mode}.prof"))
        for key in a.sort:
            s = io.StringIO()
            stats = pstats.Stats(prof, stream=s).sort_stats(key)
            # cumulative: the project's functions, not torch's or the interpreter's
            stats.print_stats(*(("(dbo|backends)/", a.top) if key == "cumulative" else (a.top,)))
            what = "own time" if key == "tottime" else "cumulative time"
            print(f"\n=== {mode} steps under cProfile, by {what}\n{s.getvalue()}")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
