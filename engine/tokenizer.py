"""Loading a model folder's tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedConfig, PreTrainedTokenizerBase
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES


def load_tokenizer(folder: str | Path) -> PreTrainedTokenizerBase:
    """``AutoTokenizer.from_pretrained(folder)``, without importing the model type's config
    class. AutoTokenizer picks the tokenizer class from the folder's ``tokenizer_config.json``
    and from the config's model type and class, which it looks up by the class's name; it loads
    the config through that class, whose module imports transformers' modelling stack (for the
    default model ~600 modules and ~50 MiB of a served process's resident memory, which the
    engine never uses). Here the config is ``config.json`` read into a bare class of the same
    name. A folder without a ``config.json``, or of a model type transformers does not know,
    takes AutoTokenizer's own way."""
    config_file = Path(folder) / "config.json"
    if not config_file.is_file():
        return AutoTokenizer.from_pretrained(folder)
    values = json.loads(config_file.read_text())
    model_type = values.get("model_type")
    class_name = CONFIG_MAPPING_NAMES.get(model_type) if isinstance(model_type, str) else None
    if class_name is None:
        return AutoTokenizer.from_pretrained(folder)
    config_class = type(class_name, (PreTrainedConfig,), {"model_type": model_type})
    config = config_class.from_dict(values)
    config._name_or_path = str(folder)  # as AutoConfig names it (AutoTokenizer matches on it)
    return AutoTokenizer.from_pretrained(folder, config=config)
