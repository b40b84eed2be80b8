"""`kvlab lab` on a busy machine: the thread choice, results saved point by point, the busy note.

Other programs' load is faked (kernels/cpu_load.measure), so these tests say the same on a quiet
machine and a busy one; no test asserts a timing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvlab.cli import main
from kvlab.kernels import cpu_load
from kvlab.kernels.cpu_load import CpuLoad
from kvlab.lab import experiment_module
from kvlab.lab.busy import caveat, choose_threads, waited
from kvlab.lab.report import table_text, verdict_text, write_results

QUICK = ["--quick", "--repeat", "1", "--no-progress"]


@pytest.fixture
def torch_threads():
    """Set torch's thread count (the lab's "one per core") for a test, and put it back after."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def fake_load(monkeypatch, cores: int, others_busy: float) -> None:
    monkeypatch.setattr(cpu_load, "measure", lambda since: CpuLoad(cores=cores, others_busy=others_busy))


def spy_threads(monkeypatch, name: str) -> list[int]:
    """torch's thread count as experiment `name` starts, appended to the returned list."""
    module = experiment_module(name)
    seen, run = [], module.run
    monkeypatch.setattr(module, "run", lambda lab: (seen.append(torch.get_num_threads()), run(lab))[1])
    return seen


def lab(model, out, *extra) -> dict:
    assert main(["lab", "kv-verify", "--model", str(model), "--out", str(out), *QUICK, *extra]) == 0
    return json.loads((out / "results.json").read_text())


def test_other_programs_holding_cores_get_the_lab_fewer_threads(tiny_chat_model, tmp_path, monkeypatch,
                                                                torch_threads, capsys):  # fmt: skip
    torch_threads(4)
    fake_load(monkeypatch, cores=4, others_busy=2.6)  # 1.4 cores free: one thread
    seen = spy_threads(monkeypatch, "kv-verify")
    results = lab(tiny_chat_model, tmp_path)
    assert seen == [1] and results["machine"]["threads"] == 1
    assert results["machine"]["cpu_others_busy"] == 2.6
    data = results["experiments"]["kv-verify"]
    assert data["threads"] == 1 and data["cpu_load"] == {"cores": 4, "others_busy": 2.6}
    assert "with 1 thread (2.6 of 4 cores busy with other programs; --threads N overrides)" in capsys.readouterr().err
    assert "--threads)" not in (tmp_path / "report.md").read_text()
    assert "1 thread used (one per core, fewer when other programs hold cores: they used 2.6 while the model " \
           "loaded; --threads overrides)" in (tmp_path / "report.md").read_text()
    assert torch.get_num_threads() == 4  # put back after the run


def test_threads_option_overrides_the_choice_and_the_report_says_the_machine_was_busy(
    tiny_chat_model, tmp_path, monkeypatch, torch_threads, capsys
):
    torch_threads(4)
    fake_load(monkeypatch, cores=4, others_busy=2.6)
    seen = spy_threads(monkeypatch, "kv-verify")
    results = lab(tiny_chat_model, tmp_path, "--threads", "3")
    assert seen == [3] and results["machine"]["threads"] == 3 and results["settings"]["threads"] == 3
    err = capsys.readouterr().err
    assert "with 3 threads (--threads; 2.6 of 4 cores busy with other programs: 1 would not wait on them)" in err
    advice = "other programs used 2.6 of 4 cores while it ran, so the lab's 3 threads waited for them; " \
             "rerun on a quiet machine, or with --threads 1"  # fmt: skip
    assert f"The machine was busy during kv-verify: {advice}" in err
    report = (tmp_path / "report.md").read_text()
    assert f"**The machine was busy** during kv-verify: {advice}." in report
    assert f"*The machine was busy: {advice}.*" in report  # beside the verdict, in the summary and the section
    assert "other programs used 2.6 of 4 cores while it ran.*" in report  # the section's footer


def test_a_quiet_machine_keeps_one_thread_per_core_and_gets_no_busy_note(tiny_chat_model, tmp_path, monkeypatch,
                                                                         torch_threads, capsys):  # fmt: skip
    torch_threads(2)
    fake_load(monkeypatch, cores=2, others_busy=0.1)
    seen = spy_threads(monkeypatch, "kv-verify")
    results = lab(tiny_chat_model, tmp_path)
    assert seen == [2] and results["machine"]["threads"] == 2
    assert "with 2 threads;" in capsys.readouterr().err
    assert "busy" not in (tmp_path / "report.md").read_text()


def test_the_thread_choice_is_run_s(monkeypatch):
    busy, quiet = CpuLoad(cores=2, others_busy=1.0), CpuLoad(cores=2, others_busy=0.0)
    assert choose_threads(None, busy, 2) == 1 == busy.threads_for(2)  # the same rule as kvlab run's
    assert choose_threads(None, quiet, 2) == 2 and choose_threads(None, None, 2) == 2  # nothing measured
    assert choose_threads(2, busy, 2) == 2  # --threads wins


def test_a_verdict_from_a_busy_machine_is_marked_not_conclusive():
    module = experiment_module("phases")
    timing = {"median_s": 1.0, "min_s": 1.0, "max_s": 1.0, "runs": 1, "samples_s": [1.0]}
    data = {  # prefill no faster at 64 tokens than at 16, decode as fast as prefill: the claim fails
        "prefill": [{"prompt_tokens": 16, "timing": timing, "tok_s": 40.0},
                    {"prompt_tokens": 64, "timing": timing, "tok_s": 40.0}],
        "decode": [{"context": 64, "new_tokens": 32, "timing": timing, "tok_s": 38.0, "token_ids": []}],
        "threads": 2, "cpu_load": {"cores": 2, "others_busy": 1.1},
    }  # fmt: skip
    text = verdict_text(module, data, quick=False)
    assert text.startswith("Did not hold on a busy machine (not conclusive): prefill ran at 40.0 tok/s")
    assert text.endswith("*The machine was busy: other programs used 1.1 of 2 cores while it ran, so the lab's 2 "
                         "threads waited for them; rerun on a quiet machine, or with --threads 1.*")  # fmt: skip
    one_thread = {**data, "threads": 1}  # the lab's one thread had a core of its own: a clean verdict
    assert waited(one_thread) is None and verdict_text(module, one_thread, quick=False).startswith("Did not hold: ")
    unmeasured = {k: v for k, v in data.items() if k != "cpu_load"}  # results.json from before the lab measured it
    assert verdict_text(module, unmeasured, quick=False).startswith("Did not hold: ")
    assert caveat("Held: fine.", data).startswith("Held on a busy machine (not conclusive): fine.")


def test_every_finished_point_is_saved_and_an_interrupted_run_keeps_them(tiny_chat_model, tmp_path, monkeypatch,
                                                                         capsys):  # fmt: skip
    import kvlab.lab.phases as phases

    fake_load(monkeypatch, cores=2, others_busy=0.0)
    on_disk = []

    def interrupted(*args, **kwargs):  # the first decode point: the prefill points must be on disk already
        on_disk.append(json.loads((tmp_path / "results.json").read_text())["experiments"]["phases"])
        raise KeyboardInterrupt

    monkeypatch.setattr(phases, "time_decode", interrupted)
    args = ["lab", "phases", "--model", str(tiny_chat_model), "--out", str(tmp_path), "--threads", "1", *QUICK]
    assert main(args) == 130  # Ctrl-C
    sizes = list(phases.QUICK_PREFILL_TOKENS)
    total = len(sizes) + len(phases.QUICK_DECODE_CONTEXTS)
    assert [p["prompt_tokens"] for p in on_disk[0]["prefill"]] == sizes
    assert on_disk[0]["partial"] == {"points_done": len(sizes), "points_total": total}
    results = json.loads((tmp_path / "results.json").read_text())  # what the interrupted run left
    kept = results["experiments"]["phases"]
    assert [p["prompt_tokens"] for p in kept["prefill"]] == sizes and kept["decode"] == []
    assert kept["partial"]["points_done"] == len(sizes)
    assert not list(tmp_path.glob("*.tmp"))  # every write renamed into place
    report = (tmp_path / "report.md").read_text()
    assert f"Not judged: unfinished, {len(sizes)} of {total} points measured" in report
    assert "| 16 |" in report  # the prefill points it measured, in the table
    assert "phases.png" not in report  # no plot of half an experiment
    capsys.readouterr()

    monkeypatch.undo()  # a rerun into the same folder measures it again, to the end
    fake_load(monkeypatch, cores=2, others_busy=0.0)
    assert main(args) == 0
    data = json.loads((tmp_path / "results.json").read_text())["experiments"]["phases"]
    assert "partial" not in data and len(data["decode"]) == len(phases.QUICK_DECODE_CONTEXTS)
    assert "unfinished" not in (tmp_path / "report.md").read_text()


def test_kv_dtype_keeps_its_speed_points_when_stopped_in_the_long_quality_pass(tiny_chat_model, tmp_path,
                                                                                monkeypatch):  # fmt: skip
    import kvlab.quality.measure as quality

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    fake_load(monkeypatch, cores=2, others_busy=0.0)
    monkeypatch.setattr(quality, "measure", stopped)
    args = ["lab", "kv-dtype", "--model", str(tiny_chat_model), "--out", str(tmp_path), "--threads", "1", *QUICK]
    assert main(args) == 130
    data = json.loads((tmp_path / "results.json").read_text())["experiments"]["kv-dtype"]
    labels = ["float32", "bfloat16", "float16", "fp8_e4m3"]  # head_dim 16: no q8_0 / q4_0 blocks
    assert [p["label"] for p in data["points"]] == labels and data["partial"] == {"points_done": 4, "points_total": 5}
    assert all(p["decode_tok_s"] > 0 and p["mean_kld"] is None for p in data["points"])
    report = (tmp_path / "report.md").read_text()
    assert "Quality not measured yet" in report and "Not judged: unfinished, 4 of 5 points measured" in report
    row = next(line for line in report.splitlines() if line.startswith("| fp8_e4m3 | 240 |"))  # bytes per token
    assert row.endswith("| – | – | – | – | – |")  # its quality columns wait for the pass that never came


def test_an_unfinished_experiment_without_points_gets_no_table_and_no_verdict():
    module = experiment_module("kv-dtype")
    data = {"context": 40, "budget_bytes": 1 << 30, "kld_tokens": 96, "ppl_ref": 1.0, "points": [], "notes": [],
            "partial": {"points_done": 1, "points_total": 5}}  # fmt: skip
    assert table_text(module, data) == "(too few points measured for a table; results.json holds them)"
    assert verdict_text(module, data, quick=False).startswith("Not judged: unfinished, 1 of 5 points measured")
    assert "`kvlab lab kv-dtype`" in verdict_text(module, data, quick=False)


def test_a_write_that_fails_halfway_leaves_the_previous_results_whole(tmp_path, monkeypatch):
    write_results({"experiments": {"a": 1}}, tmp_path)

    def half_then_fail(path, text):  # the disk fills up halfway through
        with open(path, "w") as f:
            f.write(text[: len(text) // 2])
        raise OSError("No space left on device")

    monkeypatch.setattr(Path, "write_text", half_then_fail)
    with pytest.raises(OSError):
        write_results({"experiments": {"a": 2, "b": 3}}, tmp_path)
    assert json.loads((tmp_path / "results.json").read_text()) == {"experiments": {"a": 1}}


def test_the_report_names_every_experiment_a_busy_machine_slowed_down():
    from kvlab.lab.report import busy_text

    def ran(others_busy):
        return {"threads": 2, "cpu_load": {"cores": 2, "others_busy": others_busy}}

    machine = {"load_average": 3.0, "cores": 2}
    results = {"machine": machine, "experiments": {"phases": ran(0.9), "cache": ran(0.1), "context": ran(1.6)}}
    assert busy_text(results) == (
        "**The machine was busy** during phases, context: at worst (context) other programs used 1.6 of 2 cores while "
        "it ran, so the lab's 2 threads waited for them; rerun on a quiet machine, or with --threads 1. Their timings "
        "are slower and noisier than this machine can do, and their verdicts are not conclusive."
    )
    assert busy_text({"machine": machine, "experiments": {"cache": ran(0.1)}}) == ""  # measured: quiet enough
    old = busy_text({"machine": machine, "experiments": {"cache": {}}})  # results.json from before: the load average
    assert old.startswith("**The machine was busy**: its load average was 3.0 on 2 logical CPUs")
