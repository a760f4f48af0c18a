"""The SVG timeline of a GPU kernel trace (dbo.bench.timeline): lanes per stream, boxes by kind,
the window drawn, and one-line errors for what cannot be drawn."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from dbo.bench.timeline import KINDS, gpu_events, kind_of, main, timeline_svg


def _trace() -> dict:
    def k(name, stream, ts, dur, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}
    return {"traceEvents": [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5},  # not GPU work
        k("gate_up_kernel", 7, 0, 40), k("down_kernel", 7, 40, 30),
        k("void deep_ep::intranode::dispatch<8>", 21, 10, 50),
        k("nvjet_sm90_tst_128x64", 7, 70, 20), k("Memcpy PtoP (Device -> Device)", 22, 20, 30, "gpu_memcpy"),
        k("wait_signal_kernel", 7, 90, 10), k("vectorized_elementwise_kernel", 7, 100, 100)]}


def test_kinds():
    assert kind_of("gate_up_kernel") == "experts" and kind_of("down_kernel") == "experts"
    assert kind_of("void deep_ep::internode_ll::combine<false>") == "comm"
    assert kind_of("Memcpy PtoP (Device -> Device)", "gpu_memcpy") == "comm"
    assert kind_of("nvjet_sm90_tst_64x32") == "matmul" and kind_of("wait_signal_kernel") == "wait"
    assert kind_of("vectorized_elementwise_kernel") == "other"


def test_svg_has_a_lane_per_stream_and_the_window_only():
    events = gpu_events(_trace())
    assert len(events) == 7 and [e["ts"] for e in events] == sorted(e["ts"] for e in events)
    svg = timeline_svg(_trace(), window=(0.0, 0.5), title="split <dbo>")
    root = ET.fromstring(svg)  # well-formed, the title escaped
    texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert [t for t in texts if t.startswith("stream")] == ["stream 21", "stream 22", "stream 7"]
    assert any("split <dbo>" in t and "0.10 ms shown of 0.20 ms" in t for t in texts)
    boxes = [r for r in root.iter("{http://www.w3.org/2000/svg}rect") if r.find(
        "{http://www.w3.org/2000/svg}title") is not None]
    names = [r.find("{http://www.w3.org/2000/svg}title").text for r in boxes]
    # the window [0, 100) us: the last kernel (100-200 us) is left out
    assert len(boxes) == 6 and not any("elementwise" in n for n in names)
    assert {r.get("fill") for r in boxes} == {KINDS["experts"], KINDS["comm"], KINDS["matmul"],
                                              KINDS["wait"]}


def test_what_cannot_be_drawn(tmp_path, capsys):
    with pytest.raises(ValueError, match="window"):
        timeline_svg(_trace(), window=(0.6, 0.4))
    with pytest.raises(ValueError, match="no GPU kernels"):
        timeline_svg({"traceEvents": []})
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"traceEvents": []}))
    assert main([str(empty), str(tmp_path / "out.svg")]) == 2
    assert "no GPU kernels" in capsys.readouterr().err
    good = tmp_path / "t.json"
    good.write_text(json.dumps(_trace()))
    assert main([str(good), str(tmp_path / "t.svg")]) == 0 and (tmp_path / "t.svg").exists()


def test_gzipped_traces_are_read(tmp_path, capsys):
    # the bundles under docs/results/ keep their traces gzipped
    import gzip
    from pathlib import Path

    packed = tmp_path / "t.json.gz"
    with gzip.open(packed, "wt") as f:
        json.dump(_trace(), f)
    assert main([str(packed), str(tmp_path / "t.svg")]) == 0, capsys.readouterr().err
    texts = [t.text for t in ET.parse(tmp_path / "t.svg").iter("{http://www.w3.org/2000/svg}text")]
    assert any(t.startswith("t (") for t in texts), texts  # the title: the name without .json.gz
    shipped = Path(__file__).resolve().parents[1] / "docs/results/overlap_4gpu/gpu_trace_dbo.json.gz"
    assert main([str(shipped), str(tmp_path / "dbo.svg")]) == 0, capsys.readouterr().err
    ET.parse(tmp_path / "dbo.svg")
    (tmp_path / "bad.json.gz").write_bytes(b"not gzip")
    assert main([str(tmp_path / "bad.json.gz"), str(tmp_path / "bad.svg")]) == 2
    assert "is not a JSON profiler trace" in capsys.readouterr().err
