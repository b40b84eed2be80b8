"""`kvlab lab`: reproduce the claims about inference speed and memory on the user's own machine.

Each experiment is a module with the same four names, so the runner and the report treat them alike:

    NAME     the command-line name          run(lab) -> a dataclass of figures (saved in results.json)
    TITLE    the report's section title     table(data) -> markdown, verdict(data) -> one sentence
    CLAIM    a claim about inference cost, in kvlab's words
    SOURCE   the document that made it (lab/sources.py); MEASURED: what that document measured

`table` and `verdict` read the JSON form of the results, so `kvlab lab report` re-renders a report
from results.json alone. docs/lab.md explains every experiment and how to read its figures.
"""

from __future__ import annotations

import importlib

# in the order `kvlab lab all` runs them and the report lists them
EXPERIMENTS = ("phases", "cache", "roofline", "dtype", "bits", "context", "attention", "batching", "kv-verify", "kv-dtype",
               "speculative", "long-context", "needle", "moe")


def experiment_module(name: str):
    """The module of experiment `name` (kv-verify lives in kv_verify.py)."""
    return importlib.import_module(f"kvlab.lab.{name.replace('-', '_')}")
