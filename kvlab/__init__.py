"""kvlab: an LLM inference engine that runs real models and measures what inference costs."""

from kvlab.sampling.params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name):
    # `import kvlab` stays light: the model stack loads only when LLM is first used
    if name == "LLM":
        from kvlab.llm import LLM

        return LLM
    raise AttributeError(name)
