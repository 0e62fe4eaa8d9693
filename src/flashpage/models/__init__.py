"""Model definitions and weight loaders.

* :mod:`flashpage.models.config` — :class:`ModelConfig` (validated) and :data:`BUILTIN_CONFIGS`;
  architectures: Llama 2/3.x, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3.
* :mod:`flashpage.models.llama` — :class:`LlamaForCausalLM`, the one decoder of every architecture (their
  differences are config options), a pure forward over a flattened token batch that calls the attention
  dispatch point with the step's metadata and each layer's window, softcap and scale.
* :mod:`flashpage.models.loader` — :func:`load_model` (HF safetensors directories, ``.gguf`` files, the
  embedded SmolLM2 GGUF, random ``dummy`` weights) and :func:`resolve_model_path`.
* :mod:`flashpage.models.gguf_loader` — GGUF header parsing, dequantisation, name mapping.
* :mod:`flashpage.models.tokenizer` — tokenizers from GGUF metadata or a HF directory.
"""

from __future__ import annotations

from flashpage.models.config import BUILTIN_CONFIGS, ModelConfig, get_builtin_config
from flashpage.models.llama import LlamaForCausalLM
from flashpage.models.loader import LoadedModel, load_model, resolve_model_path, save_hf_checkpoint

__all__ = [
    "BUILTIN_CONFIGS",
    "LlamaForCausalLM",
    "LoadedModel",
    "ModelConfig",
    "get_builtin_config",
    "load_model",
    "resolve_model_path",
    "save_hf_checkpoint",
]
