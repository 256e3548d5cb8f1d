"""``engine.tokenizer.load_tokenizer``: AutoTokenizer's tokenizer, without importing the model
type's config class (and with it transformers' modelling stack)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from engine.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parents[2]
TEXTS = ["Hello world", "  two  spaces and a tab\t", "héllo wörld — ünïcode ✓", ""]
MESSAGES = [{"role": "user", "content": "What is the weather?"}]


def _copy(
    source: Path, destination: Path, declared: str | None, model_type: str | None = None
) -> Path:
    """The tokenizer files and config of ``source``, with ``tokenizer_class`` set to
    ``declared`` (removed for None) and the config's ``model_type`` to ``model_type``."""
    destination.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).exists():
            shutil.copy(source / name, destination / name)
    if model_type is not None:
        config = json.loads((destination / "config.json").read_text())
        (destination / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    tokenizer_config = json.loads((destination / "tokenizer_config.json").read_text())
    tokenizer_config.pop("tokenizer_class", None)
    if declared is not None:
        tokenizer_config["tokenizer_class"] = declared
    (destination / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return destination


@pytest.mark.parametrize(
    "declared", [None, "TokenizersBackend", "PreTrainedTokenizerFast", "LlamaTokenizerFast"]
)
@pytest.mark.parametrize(
    "model_type", ["llama", "qwen2", "mistral", "mixtral", "qwen2_moe", "qwen3_moe", "unknown"]
)
def test_the_same_tokenizer_as_autotokenizer(model_type, declared, tiny_llama_dir, tmp_path):
    folder = _copy(tiny_llama_dir, tmp_path / "model", declared, model_type)
    ours, theirs = load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    assert type(ours) is type(theirs)
    assert ours.eos_token_id == theirs.eos_token_id
    assert ours.bos_token_id == theirs.bos_token_id
    assert ours.all_special_ids == theirs.all_special_ids
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text)
    assert ours.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    ) == theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)


def test_a_folder_without_a_config_takes_autotokenizers_own_way(tiny_llama_dir, tmp_path):
    folder = _copy(tiny_llama_dir, tmp_path / "tokenizer", "TokenizersBackend")
    (folder / "config.json").unlink()
    assert load_tokenizer(folder).encode("Hello world") == (
        AutoTokenizer.from_pretrained(tiny_llama_dir).encode("Hello world")
    )


def test_the_model_types_config_class_is_not_imported(tiny_llama_dir) -> None:
    """AutoTokenizer alone imports ``configuration_llama`` and through it transformers' model
    loading (~700 modules for the default model); load_tokenizer reads the config as a dict."""
    script = (
        "import sys\n"
        "from engine.tokenizer import load_tokenizer\n"
        f"tokenizer = load_tokenizer({str(tiny_llama_dir)!r})\n"
        "assert tokenizer.encode('Hello world')\n"
        "loaded = [name for name in ('transformers.models.llama.configuration_llama',\n"
        "          'transformers.core_model_loading') if name in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True,
        env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
