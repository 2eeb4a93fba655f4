"""kvoffload: offload the KV cache of LLM serving engines to cheaper tiers."""

__version__ = "0.1.0"
