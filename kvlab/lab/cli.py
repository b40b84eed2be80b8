"""`kvlab lab`: run experiments on a real model, then write results.json, report.md and the plots.

    kvlab lab phases --model smollm2-135m
    kvlab lab all --model qwen2.5-coder-0.5b --out lab-qwen --repeat 3
    kvlab lab all --model smollm2-135m --out lab-smol --compare transformers
    kvlab lab report lab-qwen/results.json

results.json is written after every point an experiment finishes, so an interrupted or slow run keeps
what it measured; running single experiments into the same --out adds them to its results (same model,
dtype and sizes). Without --threads the lab takes fewer threads when other programs hold cores, as
`kvlab run` does (lab/busy.py).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from kvlab.deps import require
from kvlab.errors import KvlabError
from kvlab.hub import DEFAULT_MODEL
from kvlab.lab import EXPERIMENTS, experiment_module

COMPARABLE = ("phases", "cache")  # the experiments --compare transformers repeats
DTYPE_NAMES = ("float32", "bfloat16", "float16")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "lab",
        help="measure prefill, decode, the KV cache and the memory wall on this machine",
        description="Reproduce the claims about LLM inference cost on this machine with a real model: "
                    f"EXPERIMENT is one of {', '.join(EXPERIMENTS)}, or `all`. `kvlab lab report RESULTS` "
                    "re-renders report.md and the plots from a results.json without measuring.",
    )  # fmt: skip
    p.add_argument("experiment", metavar="EXPERIMENT", help=f"{', '.join(EXPERIMENTS)}, all, or report")
    p.add_argument("results", nargs="?", metavar="RESULTS", help="for `report`: a results.json or its folder")
    p.add_argument("-m", "--model", default=DEFAULT_MODEL,
                   help="registry name (kvlab list; pulled first if needed), .gguf file or Hugging Face directory")
    p.add_argument("-o", "--out", metavar="DIR",
                   help="folder for results.json, report.md and plots (default: lab-MODEL in the current folder)")
    p.add_argument("--repeat", default="3", metavar="K", help="timed runs per point: median, min and max (default 3)")
    p.add_argument("--quick", action="store_true", help="tiny sizes, for tests: seconds, not minutes")
    p.add_argument("--dtype", default="float32", help=f"weights' dtype: {', '.join(DTYPE_NAMES)} (default float32)")
    p.add_argument("--threads", metavar="N",
                   help="CPU threads (default: one per core, fewer when other programs keep cores busy)")
    p.add_argument("--activation-quant", choices=["int8", "bf16x3"],
                   help="int8: the model's products over GGUF blocks with 8-bit activations, as `kvlab serve "
                        "--activation-quant int8` runs them (not exact); bf16x3: exact, on AMX bfloat16 tiles "
                        "(default: exact float32 activations)")  # fmt: skip
    p.add_argument("--compare", metavar="LIB", help="`transformers`: repeat phases and cache with transformers")
    p.add_argument("--max-prompt", metavar="T",
                   help="longest prompt to prefill; longer sizes are skipped and listed in the report")
    p.add_argument("--max-point-s", default="120", metavar="S",
                   help="stop repeating a point once its timed runs took S seconds (default 120)")
    p.add_argument("--seed", default="0", metavar="N", help="seed of the random prompts (default 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    p.set_defaults(func=run)  # fmt: skip


@dataclass
class Settings:
    repeat: int
    quick: bool
    dtype: str
    threads: int | None
    compare: str | None
    max_prompt: int | None
    max_point_s: float
    seed: int
    activation_quant: str | None = None


def run(args: argparse.Namespace) -> int:
    if args.experiment == "report":
        return report_command(args)
    names = experiment_names(args.experiment)
    settings = parse_settings(args)
    if args.results:
        raise KvlabError(f"unexpected argument '{args.results}': only `kvlab lab report` takes a results file")
    return measure(args, names, settings)


def experiment_names(name: str) -> list[str]:
    if name == "all":
        return list(EXPERIMENTS)
    if name not in EXPERIMENTS:
        raise KvlabError(f"unknown experiment '{name}': use one of {', '.join(EXPERIMENTS)}, all, or report")
    return [name]


def parse_settings(args) -> Settings:
    if args.dtype not in DTYPE_NAMES:
        raise KvlabError(f"unknown dtype '{args.dtype}': use one of {', '.join(DTYPE_NAMES)}")
    if args.compare not in (None, "transformers"):
        raise KvlabError(f"--compare takes `transformers`, not '{args.compare}'")
    if args.compare and args.experiment not in (*COMPARABLE, "all"):
        raise KvlabError(f"--compare transformers applies to {', '.join(COMPARABLE)} and all, not {args.experiment}")
    if args.compare:
        require("transformers", "--compare transformers", extra="dev")  # before any measuring
    return Settings(
        repeat=positive_int(args.repeat, "--repeat"), quick=args.quick, dtype=args.dtype,
        threads=positive_int(args.threads, "--threads") if args.threads else None, compare=args.compare,
        max_prompt=positive_int(args.max_prompt, "--max-prompt") if args.max_prompt else None,
        max_point_s=positive_float(args.max_point_s, "--max-point-s"), seed=positive_int(args.seed, "--seed", 0),
        activation_quant=getattr(args, "activation_quant", None),
    )  # fmt: skip


def positive_int(text: str, option: str, minimum: int = 1) -> int:
    try:
        value = int(text)
    except ValueError:
        raise KvlabError(f"{option} takes a whole number, not '{text}'") from None
    if value < minimum:
        raise KvlabError(f"{option} must be at least {minimum}, got {value}")
    return value


def positive_float(text: str, option: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise KvlabError(f"{option} takes a number of seconds, not '{text}'") from None
    if not value > 0:
        raise KvlabError(f"{option} must be above 0, got {text}")
    return value


def model_label(model: str) -> str:
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name or model


def command_line(args, settings: Settings, out: Path) -> str:
    """The command that repeats this run, every setting spelled out."""
    words = ["kvlab", "lab", args.experiment, "--model", args.model, "--out", str(out), "--repeat", str(settings.repeat)]
    words += ["--dtype", settings.dtype, "--max-point-s", f"{settings.max_point_s:g}", "--seed", str(settings.seed)]
    for flag, value in (("--threads", settings.threads), ("--max-prompt", settings.max_prompt),
                        ("--compare", settings.compare), ("--activation-quant", settings.activation_quant)):  # fmt: skip
        if value:
            words += [flag, str(value)]
    return shlex.join(words + (["--quick"] if settings.quick else []))


def measure(args, names: list[str], settings: Settings) -> int:
    import torch

    threads_before = torch.get_num_threads()  # run_experiments sets the lab's own
    try:
        return run_experiments(args, names, settings)
    finally:
        torch.set_num_threads(threads_before)  # main() may be called in-process (tests)


def run_experiments(args, names: list[str], settings: Settings) -> int:
    from kvlab.hub import ensure_pulled
    from kvlab.kernels import cpu_load
    from kvlab.lab.common import Lab, machine_facts, model_facts, now
    from kvlab.lab.plots import pyplot
    from kvlab.lab.report import busy_text, load_results, render, verdict_text, write_results
    from kvlab.config import Attention
    from kvlab.model.loader import load_model

    pyplot()  # the report's plots need matplotlib: find out now, not after every experiment has run
    ensure_pulled(args.model)
    machine = machine_facts()  # before loading: free RAM and load average as the run found them
    before_load = cpu_load.snapshot()
    loaded = load_model(args.model, dtype=settings.dtype, huge_pages=not settings.activation_quant)
    if not any(isinstance(layer.mixer, Attention) for layer in loaded.config.layers):
        raise KvlabError(f"kvlab lab measures softmax-attention models; {args.model} has "
                         f"{', '.join(loaded.config.count_by_label())} layers (kv-verify on another model shows "
                         "DeepSeek-V3's latent cache from its config)")  # fmt: skip
    if settings.activation_quant:  # every experiment on the lab's own model then measures that setting
        from kvlab.quant.activations import with_activation_setting

        loaded = with_activation_setting(loaded, settings.activation_quant)
    machine, threads = set_threads(machine, settings, cpu_load.measure(before_load))  # others' load as it loaded
    out = Path(args.out or f"lab-{model_label(args.model)}")
    print(f"kvlab lab: measuring {args.model} with {threads}; results go to {out.resolve()}",
          file=sys.stderr, flush=True)  # fmt: skip
    results = {
        "kvlab_lab_version": 1, "command": command_line(args, settings, out), "started": now(),
        "machine": asdict(machine), "model": asdict(model_facts(model_label(args.model), loaded, settings.dtype)),
        "load_s": loaded.load_s, "settings": asdict(settings), "experiments": {},
    }  # fmt: skip
    if (out / "results.json").exists():  # keep earlier experiments of the same model and sizes
        earlier = load_results(out)
        same = [earlier["model"]["path"], earlier["model"]["dtype"], earlier["settings"].get("quick"),
                earlier["settings"].get("activation_quant")]  # fmt: skip
        if same == [results["model"]["path"], settings.dtype, settings.quick, settings.activation_quant]:
            results["experiments"] = earlier["experiments"]
            for data in results["experiments"].values():
                data.setdefault("command", earlier["command"])  # the report credits the run that measured it
    lab = Lab(loaded, model_label(args.model), settings.dtype, settings.repeat, settings.quick,
              settings.max_prompt, settings.max_point_s, settings.seed, show_progress=not args.no_progress)  # fmt: skip
    try:
        for name in names:
            module = experiment_module(name)
            data = run_experiment(module, lab, results, out, machine.threads)
            verdict = verdict_text(module, data, settings.quick)
            print(f"## {module.TITLE}\n\n{module.table(data)}\n\n{verdict}\n", flush=True)
        if settings.compare:
            from kvlab.lab.compare import compare

            compare(lab, {n: results["experiments"][n] for n in names if n in COMPARABLE})  # measured now
            for name in COMPARABLE:
                if name in names:
                    print(f"## {name} (with transformers)\n\n{experiment_module(name).table(results['experiments'][name])}\n")
    finally:
        if results["experiments"]:
            results["finished"] = now()
            write_results(results, out)
            report = render(results, out)
            print(f"wrote {(out / 'results.json').resolve()} and {report.resolve()} (with its plots)", file=sys.stderr)
            busy = busy_text(results)
            if busy:
                print(f"kvlab lab: {busy.replace('**', '')}", file=sys.stderr)
    return 0


def run_experiment(module, lab, results: dict, out: Path, threads: int) -> dict:
    """Run one experiment into results["experiments"], writing results.json after every point it finishes
    (marked `partial`) and at its end: an interrupted or slow run keeps what it measured."""
    from kvlab.kernels import cpu_load
    from kvlab.lab.busy import load_fields
    from kvlab.lab.common import load_average, now
    from kvlab.lab.report import write_results

    started, start, load, before = now(), time.perf_counter(), load_average(), cpu_load.snapshot()

    def save(result, partial: dict | None = None) -> dict:
        """The figures as results.json keeps them, with when, how long, and how busy the CPUs were meanwhile."""
        data = asdict(result)
        data.update(started=started, finished=now(), wall_s=time.perf_counter() - start, load_average=load,
                    cpu_load=load_fields(cpu_load.measure(before)), threads=threads, command=results["command"])
        if partial:
            data["partial"] = partial
        results["experiments"][module.NAME] = data
        write_results(results, out)
        return data

    lab.on_point = lambda result, done, total: save(result, {"points_done": done, "points_total": total})
    try:
        return save(module.run(lab))
    finally:
        lab.on_point = None


def set_threads(machine, settings: Settings, load):
    """Choose the lab's threads as `kvlab run` does (lab/busy.py) and set torch's: (the machine's facts
    with them, the line that says what was chosen and why)."""
    import dataclasses

    import torch

    from kvlab.lab.busy import choose_threads

    default = torch.get_num_threads()  # one per core, as torch counts them
    threads = choose_threads(settings.threads, load, default)
    torch.set_num_threads(threads)
    text = f"{threads} thread{'s' if threads != 1 else ''}"
    if settings.threads and load is not None and load.threads_for(threads) < threads:
        text += f" (--threads; {load.describe()}: {load.threads_for(threads)} would not wait on them)"
    elif not settings.threads and threads < default:
        text += f" ({load.describe()}; --threads N overrides)"
    return dataclasses.replace(machine, threads=threads, cpu_others_busy=load.others_busy if load else None), text


def report_command(args) -> int:
    from kvlab.lab.report import load_results, render

    if not args.results:
        raise KvlabError("give the results to re-render: kvlab lab report DIR/results.json")
    path = Path(args.results)
    results = load_results(path)
    report = render(results, path if path.is_dir() else path.parent)
    print(f"wrote {report.resolve()} (with its plots)")
    return 0
