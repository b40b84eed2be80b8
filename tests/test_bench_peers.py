"""The peer benchmarks' own arithmetic, without their peers: benchmarks/bench_vllm.py (percentiles as
vLLM's benchmark computes them, kvlab ÷ vLLM taken round by round) and benchmarks/bench_rss.py (a
child's peak RSS from the kernel). vLLM and llama.cpp themselves are not needed (nor run)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench_vllm():
    return load("bench_vllm")


def test_percentiles_are_numpys_linear_ones(bench_vllm):
    xs = [5.0, 1.0, 9.5, 3.25, 7.0, 2.0, 8.0]
    for q in (0, 50, 90, 99, 100):
        assert bench_vllm.percentile(xs, q) == pytest.approx(np.percentile(xs, q))
    assert bench_vllm.percentile([], 50) is None and bench_vllm.percentile([4.0], 99) == 4.0


def test_each_run_says_what_the_vector_units_gave_then(bench_vllm):
    """The probe's G MAC/s on one thread and on two, as the run lines print them ("–" without kernels)."""
    from kvlab.kernels.probe import mac_rate

    units = bench_vllm.vector_units()
    if mac_rate(1, 0.01) is None:
        assert units == "–"
        return
    one, two = (float(x) for x in units.split("/"))
    assert one > 0 and two > 0


def test_shapes_parse(bench_vllm):
    assert [bench_vllm.shape(s) for s in bench_vllm.SHAPES] == [(16, 64, 64), (64, 256, 128)]


def test_ratios_are_taken_round_by_round(bench_vllm):
    def run(engine, r, tok_s, ttft):
        figures = {m: 1.0 for m in bench_vllm.METRICS}
        figures.update(output_tok_s=tok_s, ttft_p50_ms=ttft)
        return {**figures, "engine": engine, "round": r, "shape": "16x64x64", "client": "vllm"}

    # a slow round for both engines: the round's own ratio is what counts
    runs = [run("kvlab", 0, 200, 50), run("vllm", 0, 400, 100), run("vllm", 1, 100, 400), run("kvlab", 1, 100, 200)]
    cell = bench_vllm.summarize(runs)["16x64x64 vllm"]
    assert cell["ratio"]["output_tok_s"]["samples"] == [0.5, 1.0]
    assert cell["ratio"]["ttft_p50_ms"]["samples"] == [0.5, 0.5]
    assert cell["kvlab"]["output_tok_s"]["median"] == 150 and cell["vllm"]["output_tok_s"]["median"] == 250


MEASURE = """
import json, sys
sys.path.insert(0, sys.argv[1])
import bench_rss
from pathlib import Path
child = "b = bytearray(200_000_000); b[::4096] = b'x' * len(b[::4096]); del b; print('done')"
out = bench_rss.measured([sys.executable, "-c", child], {}, Path(sys.argv[2]) / "child.log")
try:
    bench_rss.measured([sys.executable, "-c", "raise SystemExit(3)"], {}, Path(sys.argv[2]) / "fail.log")
    out["failure_seen"] = False
except SystemExit:
    out["failure_seen"] = True
print(json.dumps(out))
"""


def test_peak_rss_of_a_child_comes_from_the_kernel(tmp_path):
    """A child that touches 200 MB for an instant and frees it: its peak, not its last RSS. Measured from
    a small process, as bench_rss.py's orchestrator is (Linux counts the spawner's peak in the child's)."""
    import json
    import subprocess

    done = subprocess.run([sys.executable, "-c", MEASURE, str(BENCHMARKS), str(tmp_path)], capture_output=True,
                          text=True, check=True)  # fmt: skip
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["spawner_peak_rss"] < 100e6 and 200e6 <= out["peak_rss"] < 200e6 + 100e6, out
    assert (tmp_path / "child.log").read_text().strip() == "done" and out["failure_seen"]
