"""The GPU host's analysis scripts that read files only (no GPU): tools/probes/smi_rows.py and
the trace summary of tools/probes/profile_decode.py."""

from __future__ import annotations

import datetime
import importlib.util
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "smi_rows", Path(__file__).resolve().parents[1] / "tools" / "probes" / "smi_rows.py")
smi_rows = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(smi_rows)

T0 = 1795582700.0  # an epoch time, in seconds


def _stamp(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]


@pytest.fixture
def files(tmp_path):
    log = tmp_path / "grid_log.txt"
    log.write_text("\n".join([
        "=== [grid] (cap 480s) $ bash -c ...",
        f"{T0:.6f} limit = max(bytes / 4.25 TB/s, flops / 795 TFLOP/s), ...",
        f"{T0 + 1:.6f} H=7168 I=256 L=32 T=1024: library, offsets 0.140 ms",
        f"{T0 + 3:.6f} H=7168 I=2048 L=256 T=65536: library, offsets 77.5 ms",
        f"{T0 + 3.1:.6f} library, offsets: geometric mean 1.34x the limit",
        "=== [grid] rc=0 (took 154 s)"]) + "\n")
    csv = tmp_path / "smi_grid.csv"
    lines = ["garbage line", "2026/11/25 04:58:20.000, [N/A], 3201 MHz, 80 W, 37, 37, 0x1"]
    # row 1 (T0, T0+1]: 1980 MHz 120 W; row 2 (T0+1, T0+3]: 1400-1440 MHz ~690 W
    for k in range(10):
        lines.append(f"{_stamp(T0 + 0.05 + 0.1 * k)}, 1980 MHz, 3201 MHz, 120.5 W, 40, 41, 0x1")
    for k in range(20):
        mhz = 1400 + 40 * (k % 2)
        lines.append(f"{_stamp(T0 + 1.05 + 0.1 * k)}, {mhz} MHz, 3201 MHz, 690 W, 58, 60, 0x4")
    csv.write_text("\n".join(lines) + "\n")
    return log, csv


def test_rows_get_the_samples_of_their_own_window(files, capsys):
    log, csv = files
    rows = smi_rows.windows(str(log))
    assert [r[0] for r in rows] == [(256, 32, 1024), (2048, 256, 65536)]
    assert rows[0][1:] == (pytest.approx(T0), pytest.approx(T0 + 1))
    s = smi_rows.samples(str(csv))
    assert len(s) == 30  # the unparsable and the [N/A] lines are skipped
    assert smi_rows.main([str(log), str(csv)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split() == ["256", "32", "1024", "10", "1980", "120", "40"]
    assert out[2].split() == ["2048", "256", "65536", "20", "1420", "690", "58"]
    assert out[-1].startswith("mean of the rows' medians: SM 1700 MHz, 405 W, 49.0 C over 2 rows")


def test_nothing_to_read_is_an_error(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.write_text("")
    assert smi_rows.main([str(empty), str(empty)]) == 1
    assert smi_rows.main([str(empty)]) == 2


def _load_probe(name: str):
    spec = importlib.util.spec_from_file_location(
        name, Path(__file__).resolve().parents[1] / "tools" / "probes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_decode_profile_reads_gpu_busy_time_syncs_and_kernels_from_a_trace():
    probe = _load_probe("profile_decode")
    # overlapping intervals count once; a gap does not count
    assert probe._busy_ms([(0, 1000), (500, 1500), (3000, 3500)]) == pytest.approx(2.0)
    assert probe._busy_ms([]) == 0.0
    events = [
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 400},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 300, "dur": 400},
        {"ph": "X", "cat": "kernel", "name": "attn", "ts": 1000, "dur": 200},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH", "ts": 1300, "dur": 100},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 1200, "dur": 250},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": 1290, "dur": 5},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 50},
        {"ph": "i", "cat": "kernel", "name": "not a span", "ts": 0},
    ]
    s = probe._trace_summary({"traceEvents": events}, steps=2, top=5)
    assert s["gpu_busy_ms_per_step"] == pytest.approx((0.7 + 0.2 + 0.1) / 2)
    assert s["kernels_per_step"] == 1.5 and s["syncs_per_step"] == 0.5
    assert s["sync_ms_per_step"] == pytest.approx(0.125) and s["d2h_copies_per_step"] == 0.5
    assert s["top_kernels_ms_per_step"][0] == ("gemm", pytest.approx(0.4))
