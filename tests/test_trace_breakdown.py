"""``python -m dbo.bench breakdown`` on a hand-made pair of profiler traces with known answers."""

from __future__ import annotations

import gzip
import json

from dbo.testing.launch import run_entry


def _k(name: str, stream: int, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def _breakdown(tmp_path, serial: list[dict], dbo: list[dict], gz: bool = False) -> tuple[dict, str]:
    """The command's rows ``{label: (serial, dbo, ratio)}`` and its output, for two traces
    written to ``tmp_path`` (the DBO one gzipped with ``gz``)."""
    paths = []
    for name, events in (("serial.json", serial), ("dbo.json.gz" if gz else "dbo.json", dbo)):
        p = tmp_path / name
        text = json.dumps({"traceEvents": events})
        if name.endswith(".gz"):
            with gzip.open(p, "wt") as f:
                f.write(text)
        else:
            p.write_text(text)
        paths.append(str(p))
    run = run_entry(["-m", "dbo.bench", "breakdown", *paths], timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    rows = {}
    lines = out.splitlines()
    assert lines[-3].startswith("  serial ms, DBO ms: "), out  # the columns, under the table
    for line in lines[1:-3]:  # the last three: the legend, the overlap arithmetic, the verdict
        if line.endswith(":"):  # a heading
            continue
        *label, a, b, r = line.split()
        rows[" ".join(label)] = (float(a), float(b), None if r == "-" else float(r))
    return rows, out


def test_breakdown_of_a_known_pair(tmp_path):
    # serial: 4 ms GEMM, then 2 ms all-to-all with the compute stream idle, then 4 ms GEMM
    serial = [_k("cutlass_gemm", 7, 0, 4000), _k("deep_ep::dispatch", 20, 4000, 2000),
              _k("cutlass_gemm", 7, 6000, 4000)]
    # DBO: the GEMMs run 10% slower beside the all-to-all, which is fully inside them
    dbo = [_k("cutlass_gemm", 7, 0, 4400), _k("deep_ep::dispatch", 20, 1000, 2000),
           _k("cutlass_gemm", 7, 4400, 4400)]
    rows, out = _breakdown(tmp_path, serial, dbo, gz=True)
    assert rows["step span"] == (10.0, 8.8, 0.88)
    assert rows["compute idle"][:2] == (2.0, 0.0)
    assert rows["kernels: grouped GEMM"] == (8.0, 8.8, 1.1)
    assert rows["kernels: DeepEP"] == (2.0, 2.0, 1.0)
    # 2 ms of idle removed, 0.8 ms of compute added: 1.2 of the 2 ms hidden
    assert out.splitlines()[-2].startswith("idle removed 2.00 ms, compute added 0.80 ms: 1.20 ms")
    assert out.splitlines()[-2].endswith("(0.60)")
    assert out.splitlines()[-1].startswith("python -m dbo.bench breakdown: PASS: the DBO step hid 1.20 ms")


def test_the_simulated_links_waits_are_not_the_compute_stream(tmp_path):
    # under the link model the waits (a spin kernel on a stream of their own) can outweigh the
    # compute: the compute stream is still the one that computes
    serial = [_k("gate_up_ws_kernel", 7, 0, 1000), _k("at::cuda::spin_kernel(long)", 30, 1000, 3000),
              _k("down_flat_kernel", 7, 4000, 1000)]
    dbo = [_k("gate_up_ws_kernel", 7, 0, 1000), _k("at::cuda::spin_kernel(long)", 30, 500, 3000),
           _k("down_flat_kernel", 7, 3500, 1000)]
    rows, out = _breakdown(tmp_path, serial, dbo)
    assert rows["compute busy"][:2] == (2.0, 2.0), out
    assert rows["compute idle"][:2] == (3.0, 2.5), out
    assert rows["kernels: link wait (simulated)"][:2] == (3.0, 3.0), out
    assert rows["kernels: fused experts"][:2] == (2.0, 2.0), out  # the library's kernel names


def test_the_compute_of_a_graph_replay_is_every_stream_it_ran_on(tmp_path):
    # a replayed CUDA graph runs its branches on streams of its own, and the link's waits may
    # share the compute's stream: the compute is the union of the compute kernels, wherever
    serial = [_k("gate_up_ws_kernel", 7, 0, 1000), _k("_nic_flow_kernel", 7, 1000, 3000),
              _k("down_flat_kernel", 7, 4000, 1000)]
    dbo = [_k("gate_up_ws_kernel", 341, 0, 1000), _k("_nic_flow_kernel", 7, 500, 3000),
           _k("_send", 7, 900, 100), _k("down_flat_kernel", 350, 3500, 1000),
           _k("gate_up_ws_kernel", 346, 500, 1000)]
    rows, out = _breakdown(tmp_path, serial, dbo)
    assert rows["compute busy"][:2] == (2.0, 2.5), out  # 0-1.5 ms and 3.5-4.5 ms
    assert rows["compute idle"][:2] == (3.0, 2.0), out
    assert rows["kernels: emulated comm work"][:2] == (0.0, 0.1), out


def _call(name: str, ts: float, dur: float, tid: int = 1) -> dict:
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid}


def test_the_host_time_splits_into_launches_waits_and_python(tmp_path):
    gpu = [_k("cutlass_gemm", 7, 0, 4000), _k("deep_ep::dispatch", 20, 4000, 2000),
           _k("cutlass_gemm", 7, 6000, 1000)]
    # the step's thread: 10 ms from its first to last event, 3 ms launching, 4 ms waiting on an
    # event, 0.5 ms recording events; a second thread's calls are not the step's
    serial = gpu + [_call("cudaLaunchKernel", 0, 1000), _call("cuLaunchKernelEx", 2000, 2000),
                    _call("cudaEventSynchronize", 5000, 4000), _call("cudaEventRecord", 9500, 500),
                    _call("cudaLaunchKernel", 0, 300, tid=2)]
    dbo = [_k("cutlass_gemm", 7, 0, 5000), _k("deep_ep::dispatch", 20, 1000, 2000)] + [
        _call("cudaLaunchKernel", 0, 2000), _call("cudaStreamSynchronize", 2000, 2000),
                 _call("cudaGraphLaunch", 4000, 1000)]
    rows, out = _breakdown(tmp_path, serial, dbo)
    assert "host (the thread that ran the step):" in out
    assert rows["span"][:2] == (10.0, 5.0)
    assert rows["launches"][:2] == (3.0, 3.0)
    assert rows["waits on the GPU"][:2] == (4.0, 2.0)
    assert rows["other CUDA calls"][:2] == (0.5, 0.0)
    assert rows["Python and dispatch"][:2] == (2.5, 0.0)
