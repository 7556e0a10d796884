"""Model implementations of the native engine (the Llama family shares one module)."""

from batchjob.engine.native.models.llama import CausalLM

__all__ = ["CausalLM"]
