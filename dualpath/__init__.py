"""DualPath: a disaggregated inference runtime for agentic, multi-turn LLM workloads.

The package root stays light: ``LLM`` is imported on first use, so the core modules (configs, geometry,
sampling parameters) can be imported without loading torch-heavy engines.
"""

from dualpath.core.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in ("LLM", "RequestOutput"):
        from dualpath import llm

        return getattr(llm, name)
    raise AttributeError(name)
