"""Tokenizers for loaded models: from a GGUF file's metadata or from a Hugging Face model directory.

Both return a ``transformers`` fast tokenizer (``PreTrainedTokenizerFast``; ``TokenizersBackend`` in
transformers 5), so the engine can ``encode``/``decode`` and ``apply_chat_template`` alike.

GGUF: transformers' own GGUF tokenizer conversion builds the tokenizer from the vocabulary, merges and
special-token ids in the metadata. ``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` would re-read
the whole header with ``gguf.GGUFReader`` (~4-8 s on SmolLM2's 49k-entry vocabulary), so when the
transformers 5 converter is importable we hand it the metadata we already parsed (~0.5 s); with older
transformers we fall back to ``AutoTokenizer``. Nothing is fetched: all loads are ``local_files_only``.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["hf_dir_has_tokenizer", "load_hf_tokenizer", "tokenizer_from_gguf"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

# llama.cpp metadata key -> transformers special token attribute
_SPECIAL_TOKENS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def tokenizer_from_gguf(metadata: dict[str, Any], path: str) -> Any:
    """A fast tokenizer for the GGUF file at ``path`` whose parsed metadata is ``metadata``.

    Raises:
        ValueError: the file carries no tokenizer, or one transformers cannot build.
    """
    if "tokenizer.ggml.tokens" not in metadata:
        raise ValueError(f"{path}: the GGUF file has no tokenizer (no tokenizer.ggml.tokens)")
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    except ImportError:  # transformers 4.x: its own (slower) GGUF path
        return _auto_tokenizer_from_gguf(path)
    grouped = {
        group: {
            name: metadata[f"tokenizer.{key}"]
            for key, name in renames.items()
            if f"tokenizer.{key}" in metadata
        }
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tok_dict, tok_config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tok_dict.get("tokenizer_type") == "llama":
        # Same default as transformers' get_gguf_tokenizer: sentencepiece vocabularies add BOS unless told.
        tok_config.setdefault("add_bos_token", True)
    tokens = tok_dict["tokens"]
    for attr, key in _SPECIAL_TOKENS.items():
        token_id = metadata.get(key)
        tok_config[attr] = tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None
    architecture = str(metadata.get("general.architecture", ""))
    try:
        backend, extra = convert_gguf_tokenizer(architecture, tok_dict)
    except (ValueError, KeyError) as e:
        raise ValueError(f"{path}: cannot build the GGUF tokenizer: {e}") from e
    tok_config.update(extra)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tok_config)


def _auto_tokenizer_from_gguf(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path), local_files_only=True
    )


def hf_dir_has_tokenizer(path: str) -> bool:
    """Whether a model directory holds tokenizer files."""
    return any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES)


def load_hf_tokenizer(path: str) -> Any | None:
    """``AutoTokenizer.from_pretrained(path)`` offline, or ``None`` when the directory has no tokenizer files."""
    if not hf_dir_has_tokenizer(path):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)
