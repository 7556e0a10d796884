"""The native engine's decoder (`decoder.py`, one module for every family), the description of each
supported Hugging Face architecture (one small module per family) and their registry.

The package itself imports nothing: its torch-free modules (`spec_key.py`, `spec_check.py`, `config_json.py`) are
read before the engine's imports."""
