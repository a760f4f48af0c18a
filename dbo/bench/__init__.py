"""dbo's benchmarks as a package: ``python -m dbo.bench COMMAND ...``.

* ``overlap`` (under torchrun): how much of the all-to-all dual-batch overlap hides, per MoE
  layer (:mod:`dbo.bench.overlap.command`);
* ``switch``: the CPU cost of one ubatch switch against a thread ping-pong (:mod:`dbo.bench.switch`);
* ``breakdown``: where a DBO step's time goes, from two torch.profiler traces
  (:mod:`dbo.bench.breakdown`);
* ``experts``: the library's experts alone at the benchmark's shapes
  (:mod:`dbo.bench.experts.command`);
* ``compare``: the best DBO step against the best serial step of any backend, from the overlap
  bundles of one run (:mod:`dbo.bench.compare`);
* ``hf-prefill``, ``hf-generate`` (under torchrun), ``hf-load``: a transformers MoE model made
  expert-parallel by dbo, plain against DBO (:mod:`dbo.bench.hf.prefill`,
  :mod:`dbo.bench.hf.generate`), and loading a real-sized checkpoint on CPU
  (:mod:`dbo.bench.hf.load`).

A command of several modules is a package of its own (``overlap/``, ``experts/``, ``hf/``); a
command of one module, and the parts the commands share, stand here. The shared parts are
reusable: :mod:`dbo.bench.timing` (a median timer, per-step GPU times over a group, launch time,
host-sync detection), :mod:`dbo.bench.limits` (the hardware limits measured in the run),
:mod:`dbo.bench.syncs` (host syncs, by call site), :mod:`dbo.bench.cli` (the simulated-link
options, beside the library's :mod:`dbo.cli`: one-line errors for bad input, the verdict line),
:mod:`dbo.bench.timeline` (a GPU trace drawn as SVG, a trace file read plain or gzipped). Process
group set-up and teardown are the library's (:mod:`dbo.peers.process_group`). So are the overlap command's
:mod:`dbo.bench.overlap.record` (what a run measured, its bundle's JSON read back),
:mod:`dbo.bench.overlap.report` (table, plot) and :mod:`dbo.bench.overlap.model` (the benchmark's
model and its stand-ins).
"""

__all__: list[str] = []
