"""`kvlab lab` on a tiny random model: every file, key and plot, the structural checks, bad input.

No test asserts a timing: the machine running the tests is shared and its timings are noise. The
quick runs use one thread, which keeps them fast on a busy machine.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import fields

import pytest
import torch

from kvlab.cli import main
from kvlab.lab import EXPERIMENTS, experiment_module
from kvlab.lab.attention import AttentionResult, PeakRSS
from kvlab.lab.batching import BatchingResult
from kvlab.lab.bits import BitsResult
from kvlab.lab.cache import CacheResult
from kvlab.lab.common import measure
from kvlab.lab.context import ContextResult
from kvlab.lab.dtype import DtypeResult
from kvlab.lab.kv_verify import KvVerifyResult
from kvlab.lab.kv_dtype import KVDtypeResult
from kvlab.lab.long_context import LongContextResult
from kvlab.lab.moe import MoeResult
from kvlab.lab.needle import NeedleResult
from kvlab.lab.phases import PhasesResult
from kvlab.lab.plots import PLOTS, nice_log_ticks
from kvlab.lab.report import verdict_text
from kvlab.lab.roofline import RooflineResult
from kvlab.lab.speculative import SpecResult

RESULT_TYPES = {
    "phases": PhasesResult, "cache": CacheResult, "roofline": RooflineResult, "dtype": DtypeResult,
    "bits": BitsResult, "context": ContextResult, "attention": AttentionResult, "batching": BatchingResult,
    "kv-verify": KvVerifyResult, "kv-dtype": KVDtypeResult, "speculative": SpecResult,
    "long-context": LongContextResult, "needle": NeedleResult, "moe": MoeResult,
}  # fmt: skip
QUICK = ["--quick", "--threads", "1", "--repeat", "2", "--no-progress"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def lab_run(tiny_chat_model, tmp_path_factory):
    """One quick `kvlab lab all` on the tiny model: (output folder, results.json as a dict)."""
    out = tmp_path_factory.mktemp("lab")
    assert main(["lab", "all", "--model", str(tiny_chat_model), "--out", str(out), *QUICK]) == 0
    return out, json.loads((out / "results.json").read_text())


def test_all_writes_every_file_and_key(lab_run):
    out, results = lab_run
    for key in ("command", "started", "finished", "machine", "model", "settings", "experiments"):
        assert key in results, key
    for key in ("cpu_model", "cores", "threads", "torch_version", "ram_available_bytes", "load_average"):
        assert key in results["machine"], key
    for key in ("name", "dtype", "weight_bytes", "decode_weight_bytes", "params"):
        assert key in results["model"], key
    assert results["machine"]["threads"] == 1 and results["settings"]["repeat"] == 2
    assert results["command"].startswith("kvlab lab all --model ")
    assert list(results["experiments"]) == list(EXPERIMENTS)
    for name, data in results["experiments"].items():
        expected = {f.name for f in fields(RESULT_TYPES[name])} | {"started", "finished", "wall_s"}
        assert expected <= set(data), (name, expected - set(data))
    for name in PLOTS:
        png = (out / f"{name}.png").read_bytes()
        assert png.startswith(PNG_MAGIC) and len(png) > 5000, name
    report = (out / "report.md").read_text()
    for name in EXPERIMENTS:
        module = experiment_module(name)
        assert "## " in report and module.TITLE in report, name
        assert verdict_text(module, results["experiments"][name], quick=True) in report
        assert (f"({name}.png)" in report) == (name in PLOTS)
    assert report.count("**Here.**") == len(EXPERIMENTS)


def test_timings_are_medians_of_the_requested_runs(lab_run):
    timing = lab_run[1]["experiments"]["phases"]["prefill"][0]["timing"]
    assert timing["runs"] == 2 == len(timing["samples_s"])
    assert timing["min_s"] <= timing["median_s"] <= timing["max_s"]


def test_structural_checks_hold(lab_run):
    exp = lab_run[1]["experiments"]
    cache = exp["cache"]
    assert cache["all_tokens_equal"] and all(p["tokens_equal"] for p in cache["points"])
    assert all(p["cached_ids"][: len(p["uncached_ids"])] == p["uncached_ids"] for p in cache["points"])
    kv = exp["kv-verify"]
    assert kv["exact"] and all(c["equal"] for c in kv["checks"])
    assert any(s["name"] == "qwen3-0.6b" and s["numbers_at_512"] == 29_360_128 for s in kv["seed_models"])
    points = exp["attention"]["points"]
    assert points and all(p["max_logit_diff"] is not None and p["max_logit_diff"] < 1e-3 for p in points)
    dtypes = [p["dtype"] for p in exp["dtype"]["points"]]
    assert dtypes == ["float32", "bfloat16", "float16"]
    bits = {p["label"]: p for p in exp["bits"]["points"]}  # a float checkpoint: no blocks of its own
    assert list(bits) == ["float32", "bfloat16", "q8_0", "q4_0"]
    held = [bits[k]["weight_bytes"] for k in bits]
    assert held == sorted(held, reverse=True)  # every format holds fewer bytes than the one before
    assert bits["q8_0"]["weight_format"] == "q8_0 (quantized at load)"
    assert 8.5 <= bits["q8_0"]["bits_per_weight"] < 9.5 and 4.5 <= bits["q4_0"]["bits_per_weight"] < 5.5
    assert [p["tokens"] for p in exp["batching"]["passes"]] == [1, 2, 4, 8, 16, 32]
    kvd = {p["label"]: p for p in exp["kv-dtype"]["points"]}  # head_dim 16: no q8_0 / q4_0 blocks
    assert list(kvd) == ["float32", "bfloat16", "float16", "fp8_e4m3"]
    assert kvd["float32"]["mean_kld"] == 0 and kvd["float32"]["same_top_p"] == 1.0
    assert kvd["bfloat16"]["bytes_per_token"] * 2 == kvd["float32"]["bytes_per_token"]
    assert kvd["fp8_e4m3"]["max_sequences"] > kvd["float16"]["max_sequences"] > kvd["float32"]["max_sequences"]
    assert 0 < kvd["bfloat16"]["mean_kld"] and all(p["decode_tok_s"] > 0 for p in kvd.values())
    assert any("q8_0 skipped" in n for n in exp["kv-dtype"]["notes"])


def test_report_rerenders_from_results_alone(lab_run, tmp_path, capsys):
    out, _ = lab_run
    shutil.copy(out / "results.json", tmp_path / "results.json")
    assert main(["lab", "report", str(tmp_path / "results.json")]) == 0
    assert (tmp_path / "report.md").read_text() == (out / "report.md").read_text()
    for name in PLOTS:
        assert (tmp_path / f"{name}.png").read_bytes().startswith(PNG_MAGIC)
    assert "report.md" in capsys.readouterr().out


def test_compare_transformers_adds_ratio_columns(tiny_chat_model, tmp_path):
    """Two single experiments into one folder: each gets transformers' figures, the results accumulate."""
    for name in ("phases", "cache"):
        args = ["lab", name, "--model", str(tiny_chat_model), "--out", str(tmp_path), "--compare", "transformers"]
        assert main([*args, *QUICK]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    phases, cache = results["experiments"]["phases"], results["experiments"]["cache"]
    assert [p["prompt_tokens"] for p in phases["transformers"]["prefill"]] == [p["prompt_tokens"] for p in phases["prefill"]]
    assert all(d["same_tokens_as_kvlab"] for d in phases["transformers"]["decode"])
    assert all(p["same_tokens_as_kvlab"] for p in cache["transformers"]["points"])
    report = (tmp_path / "report.md").read_text()
    assert report.count("kvlab ÷ transformers") == 3  # prefill, decode and cache tables
    assert "`kvlab lab phases " in report and "`kvlab lab cache " in report  # each run is credited


@pytest.mark.parametrize(
    "args",
    [
        ["lab", "nonsense", "--model", "MODEL"],
        ["lab", "phases", "--model", "MODEL", "--repeat", "0"],
        ["lab", "phases", "--model", "MODEL", "--repeat", "many"],
        ["lab", "phases", "--model", "no-such-model"],
        ["lab", "roofline", "--model", "MODEL", "--compare", "transformers"],
        ["lab", "phases", "--model", "MODEL", "--dtype", "int3"],
        ["lab", "report"],
        ["lab", "report", "/nonexistent/results.json"],
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, tiny_chat_model, capsys):
    args = [str(tiny_chat_model) if a == "MODEL" else a for a in args]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvlab: error: ") and err.count("\n") == 1, err


def test_measure_discards_the_warmup_and_stops_at_the_time_limit():
    calls = []
    timing = measure(lambda: calls.append(1), repeat=3)
    assert len(calls) == 4 and timing.runs == 3
    calls.clear()
    timing = measure(lambda: calls.append(1), repeat=5, warmup=0, max_total_s=-1.0)
    assert len(calls) == 1 and timing.runs == 1  # over the limit after the first run


def test_peak_rss_sees_a_short_lived_allocation():
    with PeakRSS() as peak:
        big = torch.ones(50 * 2**20 // 4)  # 50 MiB, every page written
        time.sleep(0.05)
        del big
    assert peak.delta_bytes >= 40 * 2**20


def test_quick_report_judges_no_claim_and_names_each_source(lab_run):
    out, results = lab_run
    report = (out / "report.md").read_text()
    summary = report.split("## Summary", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in summary.splitlines() if line.startswith("- ")]
    assert len(lines) == len(EXPERIMENTS) and all("Not judged (quick run):" in line for line in lines)
    assert "Held:" not in report and "Did not hold:" not in report
    assert "the seed" not in report.lower() and "seed-0" not in report  # words no reader knows
    for name in EXPERIMENTS:
        module = experiment_module(name)
        assert f"as {module.SOURCE.title} makes it" in report and module.MEASURED in report, name


def test_model_defaults_and_the_lab_says_where_it_wrote(tiny_chat_model, tmp_path, monkeypatch, capsys):
    from kvlab.cli import build_parser
    from kvlab.hub import DEFAULT_MODEL

    assert build_parser().parse_args(["lab", "all", "--quick"]).model == DEFAULT_MODEL
    monkeypatch.chdir(tmp_path)
    assert main(["lab", "kv-verify", "--model", str(tiny_chat_model), *QUICK]) == 0
    folder = tmp_path / f"lab-{tiny_chat_model.name}"
    assert (folder / "report.md").is_file()
    assert f"wrote {folder / 'results.json'} and {folder / 'report.md'}" in capsys.readouterr().err


@pytest.mark.parametrize("lo, hi", [(4.2, 17.6), (0.11, 0.26), (1e9, 3e10), (20, 30), (0.3, 200)])
def test_log_axes_get_three_labels_spread_over_the_range(lo, hi):
    import math

    ticks = nice_log_ticks(lo, hi)
    assert len(ticks) >= 3 and all(lo <= t <= hi for t in ticks)
    edges = [math.log10(x) for x in [lo, *ticks, hi]]
    assert max(b - a for a, b in zip(edges, edges[1:])) <= math.log10(hi / lo) / 2


def test_plots_label_their_log_axes_and_keep_the_legend_off_the_title(lab_run):
    from kvlab.lab.plots import PLOTS, pyplot

    plt = pyplot()
    _, results = lab_run
    for name in ("cache", "attention", "bits", "roofline"):
        fig = PLOTS[name](plt, results["experiments"][name])
        fig.canvas.draw()
        ax = fig.axes[0]
        labels = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
        assert len(labels) >= 3 and not any("^" in t or "e+" in t for t in labels), (name, labels)
        plt.close(fig)
    fig = PLOTS["context"](plt, results["experiments"]["context"])
    fig.canvas.draw()
    ax = fig.axes[0]
    legend = ax.get_legend().get_window_extent()
    assert len(ax.get_legend().get_texts()) == 2  # both axes' series in one legend
    assert legend.y1 < ax.get_window_extent().y0  # under the plot, clear of the title
    plt.close(fig)


def test_roofline_sets_prefill_and_decode_against_the_measured_arithmetic_roof(lab_run):
    """The FMA loop's rate is measured on the lab's threads; the verdict and the table give each phase's
    FLOP/s as a share of twice it (two FLOPs a multiply-add), and say nothing of it where it is absent."""
    from kvlab.kernels import gemv
    from kvlab.lab import roofline

    _, results = lab_run
    data = dict(results["experiments"]["roofline"])
    assert data["roof_threads"] == (1 if gemv.gemv_available() else 0)  # QUICK runs on one thread
    assert (data["mac_roof_g"] > 0) == gemv.gemv_available()
    data["mac_roof_g"], data["roof_threads"] = 50.0, 1  # 100 GFLOP/s
    data["prefill"] = {**data["prefill"], "flop_s": 40e9}
    data["decode"] = {**data["decode"], "flop_s": 2e9}
    text = roofline.verdict(data)
    assert text.endswith("A loop of float32 FMAs makes 100 GFLOP/s here: prefill ran at 40% of that arithmetic "
                         "roof, decode at 2%."), text  # fmt: skip
    assert "prefill ran at 40% of it, decode at 2%" in roofline.table(data)
    data["mac_roof_g"] = 0.0
    assert "FMAs" not in roofline.verdict(data) and "FMAs" not in roofline.table(data)
