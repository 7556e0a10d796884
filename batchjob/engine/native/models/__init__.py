"""The native engine's decoder (`decoder.py`, one module for every family), the description of each
supported Hugging Face architecture (one small module per family) and their registry."""

from batchjob.engine.native.models.decoder import CausalLM

__all__ = ["CausalLM"]
