"""A model's tokenizer, loaded as `AutoTokenizer` would, minus a start-up cost it does not need.

`AutoTokenizer.from_pretrained` always loads the model's config first. In transformers 5 that imports the
architecture's config module, which builds transformers' lazy import table for every model it ships
(reading thousands of source files) and imports `torch.distributed.tensor`: seconds of start-up, paid by
the job's checks and again by the engine. A directory whose `tokenizer_config.json` names the generic fast
class (`PreTrainedTokenizerFast`, as Llama 3 checkpoints do, or `TokenizersBackend`, its transformers 5
name) is loaded through that class directly: `AutoTokenizer` would resolve the name to the same class and
call the same `from_pretrained` on the same files. Anything else (a model-specific class, a hub id, remote
code) goes through `AutoTokenizer`.
"""

from __future__ import annotations

import json
from pathlib import Path

GENERIC_FAST_CLASSES = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})


def load_tokenizer(model_path: str | Path):
    path = Path(model_path)
    if _names_generic_fast_class(path):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def _names_generic_fast_class(path: Path) -> bool:
    config, vocabulary = path / "tokenizer_config.json", path / "tokenizer.json"
    if not (config.is_file() and vocabulary.is_file()):
        return False
    try:
        settings = json.loads(config.read_text())
    except (OSError, ValueError):
        return False  # AutoTokenizer reports it
    return settings.get("tokenizer_class") in GENERIC_FAST_CLASSES and "auto_map" not in settings
