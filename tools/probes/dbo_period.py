"""What two overlapped ubatches can reach when compute and one link take turns: a model of the
per-layer period of DBO's schedule, to set beside a measured step.

    python tools/probes/dbo_period.py --experts-ms 27.3 --attn-ms 0.7 --link-ms 23.05
    python tools/probes/dbo_period.py ... --orders dbo attn-stream chunked2

Each ubatch runs, per layer: attention (compute stream), dispatch (the link), experts (compute
stream), combine (the link); the numbers are per layer for the whole batch (both ubatches), as
`dbo.bench overlap` prints them (`compute` = attention + experts, `comm`). The compute stream
and the link each run their work in the order it was queued (one CUDA stream; one NIC, shared
by both ubatches' transfers), and an op starts when its resource is free and the op it needs
has ended. The host queues in dbo's order: A's attention and dispatch, B's attention and
dispatch, A's experts and combine, B's experts and combine, then the next layer.

Orders:

* ``dbo``: as above (what ``overlapped_forward`` queues, yielding at each dispatch and combine);
* ``attn-stream``: the attention on a stream of its own (it no longer waits behind the other
  ubatch's experts; it shares nothing in the model, so this is its best case);
* ``chunked2``: each ubatch's experts queued in two halves, the other ubatch's next attention
  queued between them.

And for the link, ``--link-orders``: ``fifo`` serves the transfers in the order they were queued
(what one CUDA stream does, the simulated link's stream or a comm stream shared by both
ubatches: a transfer whose data is not ready yet holds back one queued after it that is),
``ready`` in the order their data becomes ready (a NIC with a queue pair per flow).

Prints, per order, the steady-state period per layer, the serial layer (everything in turn), the
bound max(compute, link) and the speedup over serial. With the attention on its own stream the
model lets it run beside the experts for free, so the period can fall below that bound: read
that row as the best case. No GPU: arithmetic only.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

ORDERS = ("dbo", "attn-stream", "chunked2")
LINK_ORDERS = ("fifo", "ready")


@dataclass
class Op:
    name: str
    resource: str
    ms: float
    after: list[Op] = field(default_factory=list)
    end: float | None = None


def _ops(order: str, layers: int, attn: float, experts: float, link: float) -> list[Op]:
    """The ops of ``layers`` layers, two ubatches, in the order the host queues them."""
    a, e, lk = attn / 2, experts / 2, link / 4  # per ubatch; a dispatch or a combine each
    attn_res = "attn" if order == "attn-stream" else "compute"
    queue: list[Op] = []
    last_combine: dict[str, Op | None] = {"A": None, "B": None}
    pending: dict[str, Op] = {}  # each ubatch's next dispatch, queued by the previous layer

    def attention(u: str, layer: int) -> tuple[Op, Op]:
        prev = last_combine[u]
        at = Op(f"attn{u}{layer}", attn_res, a, [prev] if prev else [])
        dispatch = Op(f"disp{u}{layer}", "link", lk, [at])
        return at, dispatch

    for layer in range(layers):
        if layer == 0:
            at_a, d_a = attention("A", 0)
            at_b, d_b = attention("B", 0)
            queue += [at_a, d_a, at_b, d_b]
        else:
            d_a, d_b = pending["A"], pending["B"]
        if order == "chunked2":
            x_a1 = Op(f"expA{layer}.1", "compute", e / 2, [d_a])
            x_a2 = Op(f"expA{layer}.2", "compute", e / 2, [x_a1])
            c_a = Op(f"combA{layer}", "link", lk, [x_a2])
            x_b1 = Op(f"expB{layer}.1", "compute", e / 2, [d_b, x_a2])
            x_b2 = Op(f"expB{layer}.2", "compute", e / 2, [x_b1])
            c_b = Op(f"combB{layer}", "link", lk, [x_b2])
            last_combine.update(A=c_a, B=c_b)
            queue += [x_a1, x_a2, c_a, x_b1]
            if layer + 1 < layers:  # A's next attention between B's halves
                at_a, na = attention("A", layer + 1)
                queue += [at_a, na]
            queue += [x_b2, c_b]
            if layer + 1 < layers:
                at_b, nb = attention("B", layer + 1)
                queue += [at_b, nb]
                pending.update(A=na, B=nb)
            continue
        x_a = Op(f"expA{layer}", "compute", e, [d_a])
        c_a = Op(f"combA{layer}", "link", lk, [x_a])
        x_b = Op(f"expB{layer}", "compute", e, [d_b])
        c_b = Op(f"combB{layer}", "link", lk, [x_b])
        last_combine.update(A=c_a, B=c_b)
        queue += [x_a, c_a, x_b, c_b]
        if layer + 1 < layers:
            at_a, na = attention("A", layer + 1)
            at_b, nb = attention("B", layer + 1)
            queue += [at_a, na, at_b, nb]
            pending.update(A=na, B=nb)
    return queue


def simulate(order: str, layers: int, attn: float, experts: float, link: float,
             link_order: str = "fifo") -> float:
    """The steady-state period per layer (ms): the time between the ends of the last layers.

    ``link_order``: ``fifo`` serves the link's transfers in the order they were queued (one CUDA
    stream for both ubatches' transfers); ``ready``, in the order they become ready (a transfer
    that is ready does not wait behind one queued before it that is not).
    """
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    if link_order not in LINK_ORDERS:
        raise ValueError(f"link_order must be one of {LINK_ORDERS}, got {link_order!r}")
    queues: dict[str, list[Op]] = {}
    for op in _ops(order, layers, attn, experts, link):
        queues.setdefault(op.resource, []).append(op)
    free = dict.fromkeys(queues, 0.0)
    ends = []
    while any(queues.values()):
        best = None
        for res, q in queues.items():
            heads = q if (res == "link" and link_order == "ready") else q[:1]
            for pos, op in enumerate(heads):
                if any(d.end is None for d in op.after):
                    continue
                ready = max([d.end for d in op.after], default=0.0)
                key = (max(free[res], ready), ready, pos)
                if best is None or key < best[0]:
                    best = (key, res, op)
        if best is None:
            raise RuntimeError("the queues wait on each other")  # an inconsistent queue order
        (start, _, _), res, op = best
        op.end = start + op.ms
        free[res] = op.end
        queues[res].remove(op)
        if op.name.startswith("combB"):
            ends.append(op.end)
    ends.sort()
    tail = ends[len(ends) // 2:-2]  # past the ramp, before the last layers (nothing queued after them)
    return (tail[-1] - tail[0]) / (len(tail) - 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts-ms", type=float, required=True, help="experts per layer, whole batch")
    p.add_argument("--attn-ms", type=float, required=True,
                   help="everything else on the compute stream per layer (attention, router)")
    p.add_argument("--link-ms", type=float, required=True, help="dispatch + combine per layer (comm)")
    p.add_argument("--layers", type=int, default=40)
    p.add_argument("--orders", nargs="+", choices=ORDERS, default=list(ORDERS))
    p.add_argument("--link-orders", nargs="+", choices=LINK_ORDERS, default=list(LINK_ORDERS))
    a = p.parse_args(argv)
    if min(a.experts_ms, a.attn_ms, a.link_ms) < 0 or a.layers < 12:
        p.error("times must be >= 0 and --layers >= 12")
    compute = a.experts_ms + a.attn_ms
    serial = compute + a.link_ms
    bound = max(compute, a.link_ms)
    print(f"per layer: compute {compute:.2f} ms, link {a.link_ms:.2f} ms, serial {serial:.2f} ms, "
          f"bound max(compute, link) {bound:.2f} ms ({serial / bound:.3f}x serial)")
    for link_order in a.link_orders:
        for order in a.orders:
            period = simulate(order, a.layers, a.attn_ms, a.experts_ms, a.link_ms, link_order)
            print(f"{order:>12}, link {link_order:>5}: {period:7.2f} ms per layer, "
                  f"{serial / period:.3f}x serial, {period / bound:.3f}x the bound")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
