"""kvlab: an LLM inference engine that runs real models and measures what inference costs."""

import os
import sys

# PyTorch's OpenMP threads spin after each operation (GOMP's default: 300,000 turns) for the next
# one; between them kvlab's own thread pool runs the products, and on a machine of few cores the
# spinning threads take the cores from it (a 1,024-token prompt on 2 cores, int8 products: 814 -> 979
# tok/s at 10,000 turns). Read once, when PyTorch loads its OpenMP: a value the user set is kept.
# Too late when PyTorch came first (`import torch` above `import kvlab`): LLM() then says so once.
OPENMP_SPIN_TOO_LATE = "torch" in sys.modules and not {"GOMP_SPINCOUNT", "OMP_WAIT_POLICY"} & set(os.environ)
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

from kvlab.sampling.params import SamplingParams  # noqa: E402

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name):
    # `import kvlab` stays light: the model stack loads only when LLM is first used
    if name == "LLM":
        from kvlab.llm import LLM

        return LLM
    raise AttributeError(name)
