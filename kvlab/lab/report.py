"""results.json → report.md and the PNG plots beside it; also the number formats every table uses.

The report has a header (model, machine, command, times), a summary of the verdicts, then one section
per experiment: the claim, the table, the plot and the verdict sentence, which each experiment
computes from its own figures. Nothing here measures: `kvlab lab report results.json` re-renders.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvlab.errors import KvlabError

RESULTS_FILE, REPORT_FILE = "results.json", "report.md"


# ---- number formats ----------------------------------------------------------------------------


def num(x: float | int, digits: int | None = None) -> str:
    """1024 → "1,024"; num(3.14159, 2) → "3.14". Floats without `digits`: 2 decimals below 10, 1 below
    100, none above (1,234), and two significant figures for what would round to zero (0.0042)."""
    if isinstance(x, int) and digits is None:
        return f"{x:,}"
    if digits is None:
        digits = 0 if abs(x) >= 100 else 1 if abs(x) >= 10 else 2
    text = f"{x:,.{digits}f}"
    if x and float(text.replace(",", "")) == 0:  # too small for these decimals: two significant figures
        return f"{x:.2g}"
    return text


def ratio(x: float) -> str:
    """A factor: 2.46 → "2.5×", 12.3 → "12×", 0.456 → "0.46×"."""
    return f"{x:.0f}×" if x >= 10 else f"{x:.1f}×" if x >= 1 else f"{x:.2f}×"


def faster(x: float, than: str = "") -> str:
    """A speed ratio (old time ÷ new time): 1.7 → "1.7× faster", 0.1 → "10× slower", 1.02 → "about as
    fast"; `than` names what it is compared with ("1.7× faster than float32")."""
    if abs(x - 1) < 0.05:
        return f"about as fast as {than}" if than else "about as fast"
    text = f"{ratio(x)} faster" if x >= 1 else f"{ratio(1 / x)} slower"
    return f"{text} than {than}" if than else text


def pct(x: float) -> str:
    return f"{x * 100:.0f}%"


def gb(n_bytes: int) -> str:
    return f"{n_bytes / 2**30:.2f} GiB"


def spread(timing: dict, scale: float = 1e3, digits: int | None = None) -> str:
    """A Timing as "median (min–max)", in milliseconds unless `scale` says otherwise."""
    med, lo, hi = (timing[k] * scale for k in ("median_s", "min_s", "max_s"))
    if timing["runs"] == 1:
        return f"{num(med, digits)} (1 run)"
    return f"{num(med, digits)} ({num(lo, digits)}–{num(hi, digits)})"


def held(ok: bool, partly: bool = False) -> str:
    return "Held" if ok else "Partly held" if partly else "Did not hold"


NOT_JUDGED = "Not judged (quick run)"


def verdict_text(module, data: dict, quick: bool) -> str:
    """The experiment's verdict; after --quick its figures are given but the claim is not judged on them;
    an unfinished experiment is not judged at all; one measured on a busy machine says so (lab/busy.py)."""
    from kvlab.lab.busy import caveat

    if data.get("partial"):
        return unfinished_text(module, data)
    text = module.verdict(data)
    if quick:
        for word in ("Held", "Partly held", "Did not hold", "Not judged"):  # held(), or an experiment that cannot judge
            if text.startswith(word + ":"):
                text = NOT_JUDGED + text[len(word) :]
                break
    return caveat(text, data)


def unfinished_text(module, data: dict) -> str:
    done, total = data["partial"]["points_done"], data["partial"]["points_total"]
    return (f"Not judged: unfinished, {done} of {total} points measured (the run was interrupted, or is still "
            f"going); `kvlab lab {module.NAME}` with the same --out measures it again.")  # fmt: skip


def md_table(head: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


# ---- results.json --------------------------------------------------------------------------------


def load_results(path: str | Path) -> dict:
    path = Path(path)
    if path.is_dir():
        path = path / RESULTS_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise KvlabError(f"no results file at {path}: run `kvlab lab all --model M --out DIR` first") from None
    except (OSError, json.JSONDecodeError) as e:
        raise KvlabError(f"{path}: cannot read it as results.json ({e})") from None
    if not isinstance(data, dict) or "experiments" not in data or "model" not in data:
        raise KvlabError(f"{path}: not a kvlab lab results file (no 'experiments' or 'model')")
    return data


def write_results(results: dict, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    return write_atomically(out_dir / RESULTS_FILE, json.dumps(results, indent=1) + "\n")


def write_atomically(path: Path, text: str) -> Path:
    """Write to a temporary file beside `path`, then rename it: a crash mid-write never leaves half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return path


# ---- the report ----------------------------------------------------------------------------------


def render(results: dict, out_dir: Path) -> Path:
    """Write report.md and one PNG per experiment that has a plot into `out_dir`; return the report's path."""
    from kvlab.lab import EXPERIMENTS, experiment_module
    from kvlab.lab.plots import PLOTS, draw

    out_dir.mkdir(parents=True, exist_ok=True)
    done = [name for name in EXPERIMENTS if name in results["experiments"]]
    quick = bool(results["settings"].get("quick"))
    sections, summary = [], []
    for i, name in enumerate(done, 1):
        module, data = experiment_module(name), results["experiments"][name]
        verdict = verdict_text(module, data, quick)
        summary.append(f"- **{module.TITLE}.** {verdict}")
        parts = [f"## {i}. {module.TITLE}", f"**The claim**, as {module.SOURCE.title} makes it: {module.CLAIM} "
                 f"*Measured there: {module.MEASURED}.*", table_text(module, data)]  # fmt: skip
        if name in PLOTS and not data.get("partial"):
            draw(name, data, results["model"]["name"], out_dir / f"{name}.png")
            parts.append(f"![{module.TITLE}]({name}.png)")
        parts.append(f"**Here.** {verdict}")
        if data.get("notes"):
            parts.append("Notes:\n" + "\n".join(f"- {note}" for note in data["notes"]))
        parts.append(footer(data))
        sections.append("\n\n".join(parts))
    text = "\n\n".join([header(results), "## Summary", "\n".join(summary), *sections]) + "\n"
    return write_atomically(out_dir / REPORT_FILE, text)


def table_text(module, data: dict) -> str:
    """The experiment's table; an unfinished one's points so far, where they make a table."""
    if not data.get("partial"):
        return module.table(data)
    try:  # tables are written for finished experiments: some need points that were never measured
        return module.table(data)
    except (KeyError, IndexError, TypeError, ValueError, ZeroDivisionError):
        return "(too few points measured for a table; results.json holds them)"


def footer(data: dict) -> str:
    """How long the experiment took, when it finished, and how busy the machine was."""
    text = f"*{num(data.get('wall_s', 0.0), 0)} s, finished {data.get('finished', '?')}"
    if "load_average" in data:
        text += f", load average {data['load_average']:.1f} at its start"
    if data.get("cpu_load"):
        load = data["cpu_load"]
        text += f", other programs used {load['others_busy']:.1f} of {load['cores']} cores while it ran"
    return text + ".*"


def commands(results: dict) -> list[str]:
    """Each command that measured some of these results, with the experiments it measured."""
    from kvlab.lab import EXPERIMENTS

    by_command: dict[str, list[str]] = {}
    for name in EXPERIMENTS:
        if name in results["experiments"]:
            command = results["experiments"][name].get("command", results["command"])
            by_command.setdefault(command, []).append(name)
    if len(by_command) <= 1:
        return [f"`{results['command']}`"]
    return [f"`{command}` ({', '.join(names)})" for command, names in by_command.items()]


def first_start(results: dict) -> str:
    starts = [d["started"] for d in results["experiments"].values() if "started" in d]
    return min(starts + [results["started"]])


def header(results: dict) -> str:
    m, mc, s = results["model"], results["machine"], results["settings"]
    facts = md_table(["", ""], [
        ["model", f"{m['name']} ({m['architecture']}, {num(m['params'] / 1e6, 0)} M parameters, "
                  f"{num(m['num_layers'])} layers, {m['num_heads']} / {m['num_kv_heads']} query / KV heads)"],
        ["weights in memory", f"{m.get('weight_format', m['dtype'])}, {num(m['weight_bytes'] / 1e6, 0)} MB "
                              f"({num(m['decode_weight_bytes'] / 1e6, 0)} MB streamed per decode step)"],
        ["CPU", f"{mc['cpu_model']}, {mc['cores']} logical CPUs, {mc['threads']} "
                f"thread{'s' if mc['threads'] > 1 else ''} used{threads_reason(results)}"],
        ["memory", f"{num(mc['ram_total_bytes'] / 2**30, 1)} GiB, {num(mc['ram_available_bytes'] / 2**30, 1)} GiB "
                   "free at the start"],
        ["software", f"torch {mc['torch_version']}, Python {mc['python_version']}, {mc['platform']}, "
                     f"GEMV kernel {'on' if mc['gemv_kernel'] else 'off'}"],
        ["repeats", f"median of {s['repeat']} runs (min–max in brackets) after a warm-up; a point stops "
                    f"repeating after {num(s['max_point_s'], 0)} s of runs"],
        ["command" if len(commands(results)) == 1 else "commands", "<br>".join(commands(results))],
        ["measured", f"{first_start(results)} → {results.get('finished', '(unfinished)')}"],
    ])  # fmt: skip
    lines = [
        f"# kvlab lab: {m['name']} on {mc['cpu_model']}",
        "Each section below takes one claim about inference cost from the course material this lab follows "
        "(a course module and a blog post, each named with its claim), measures it on this machine with this "
        "model, and says whether it held. Prompts are random token ids (a pass costs the same whichever "
        "tokens it reads) except where a section says it reads real text; all timings are wall-clock.",
        facts,
    ]
    if s.get("quick"):
        lines.append("**Quick run**: tiny sizes for testing; the figures say nothing about the claims, so none "
                     "is judged.")
    busy = busy_text(results)
    if busy:
        lines.append(busy)
    return "\n\n".join(lines)


def threads_reason(results: dict) -> str:
    """Why the lab measured with the threads it did (empty for results from before it chose them)."""
    mc, requested = results["machine"], results["settings"].get("threads")
    if requested:
        return " (--threads)"
    if mc.get("cpu_others_busy") is None:
        return ""
    return (f" (one per core, fewer when other programs hold cores: they used {mc['cpu_others_busy']:.1f} while "
            "the model loaded; --threads overrides)")  # fmt: skip


def busy_text(results: dict) -> str:
    """A paragraph when other programs slowed the lab's threads down: which experiments, how to rerun."""
    from kvlab.lab import EXPERIMENTS
    from kvlab.lab.busy import advice, waited

    experiments = results["experiments"]
    if not any(d.get("cpu_load") for d in experiments.values()):  # results from before it measured, or not Linux
        mc = results["machine"]
        if mc["load_average"] - 0.5 <= 0:
            return ""
        return (f"**The machine was busy**: its load average was {mc['load_average']:.1f} on {mc['cores']} logical "
                "CPUs before the run started, so other programs competed for the CPUs and timings are noisier "
                "and slower than on an idle machine.")  # fmt: skip
    hit = [(name, waited(experiments[name])) for name in EXPERIMENTS if name in experiments]
    hit = [(name, load) for name, load in hit if load is not None]
    if not hit:
        return ""
    name, worst = max(hit, key=lambda h: h[1].others_busy)
    text = advice(worst, experiments[name]["threads"])
    if len(hit) == 1:
        return (f"**The machine was busy** during {name}: {text}. Its timings are slower and noisier than this "
                "machine can do, and its verdict is not conclusive.")  # fmt: skip
    return (f"**The machine was busy** during {', '.join(n for n, _ in hit)}: at worst ({name}) {text}. Their "
            "timings are slower and noisier than this machine can do, and their verdicts are not "
            "conclusive.")  # fmt: skip
