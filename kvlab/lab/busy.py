"""Other programs on the lab's CPUs: how many threads the lab measures with, and what a busy run says.

The lab picks its threads as `kvlab run`, `chat` and `serve` do (kvlab/kernels/cpu_load.py): it
measures other programs' load on the CPUs while the model loads and takes a thread fewer for each
core they hold; `--threads` overrides. Each experiment measures that load again over its own run
(`cpu_load` beside its figures in results.json). Where other programs left fewer free cores than the
lab had threads, every OpenMP barrier waited for a descheduled thread: the figures say more about the
other programs than about the claim, so the verdict carries a caveat and says how to rerun.
"""

from __future__ import annotations

from kvlab.kernels.cpu_load import CpuLoad


def choose_threads(requested: int | None, load: CpuLoad | None, default: int) -> int:
    """--threads when given; else `default` (one per core), fewer when other programs hold cores."""
    if requested:
        return requested
    return load.threads_for(default) if load is not None else default


def load_fields(load: CpuLoad | None) -> dict | None:
    """A CpuLoad as results.json holds it (None where nothing could be measured)."""
    return None if load is None else {"cores": load.cores, "others_busy": round(load.others_busy, 3)}


def waited(data: dict) -> CpuLoad | None:
    """The load other programs put on the CPUs while an experiment ran, when it left fewer free cores
    than the lab's threads (so its threads waited for them); None on a quiet enough machine or when the
    results hold no measurement (results.json from before the lab measured it)."""
    load, threads = data.get("cpu_load"), data.get("threads")
    if not load or not threads:
        return None
    load = CpuLoad(cores=load["cores"], others_busy=load["others_busy"])
    return load if load.threads_for(threads) < threads else None


def advice(load: CpuLoad, threads: int) -> str:
    """What happened and how to rerun: "other programs used 1.2 of 2 cores, and the lab's 2 threads ..."."""
    fewer = load.threads_for(threads)
    return (
        f"other programs used {load.others_busy:.1f} of {load.cores} cores while it ran, so the lab's {threads} "
        f"thread{'s' if threads != 1 else ''} waited for them; rerun on a quiet machine, or with --threads {fewer}"
    )


def caveat(verdict: str, data: dict) -> str:
    """The verdict, marked inconclusive when the experiment ran on a busy machine."""
    load = waited(data)
    if load is None:
        return verdict
    for word in ("Did not hold", "Partly held", "Held"):
        if verdict.startswith(word + ":"):
            verdict = f"{word} on a busy machine (not conclusive):{verdict[len(word) + 1 :]}"
            break
    return f"{verdict} *The machine was busy: {advice(load, data['threads'])}.*"
