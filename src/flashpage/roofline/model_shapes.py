"""Shapes of decoder-only transformers: what the FLOP/byte model needs to know about a model.

Built-in shapes (figures from each model's Hugging Face ``config.json``):

========================  ======  ============  ======  =====  ========  ========  =======  ======
name                      hidden  intermediate  layers  heads  kv heads  head_dim  vocab    tied
========================  ======  ============  ======  =====  ========  ========  =======  ======
smollm2-135m              576     1536          30      9      3         64        49152    yes
llama-3-8b                4096    14336         32      32     8         128       128256   no
llama-3-70b               8192    28672         80      64     8         128       128256   no
mistral-7b                4096    14336         32      32     8         128       32000    no
qwen3-0.6b                1024    3072          28      16     8         128       151936   yes
========================  ======  ============  ======  =====  ========  ========  =======  ======

``get_model_shape`` also reads a Hugging Face ``config.json`` (or a directory holding one).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

__all__ = ["ModelShape", "get_model_shape", "known_model_names", "model_shape_from_config"]


@dataclass(frozen=True)
class ModelShape:
    """Dimensions of a Llama-style decoder-only transformer (SwiGLU MLP, GQA attention).

    Attributes:
        hidden: model width.
        intermediate: MLP width (gate and up project hidden -> intermediate, down projects back).
        layers: number of decoder layers.
        heads: query heads; ``kv_heads`` key/value heads (``heads % kv_heads == 0``).
        head_dim: per-head width (``heads * head_dim`` need not equal ``hidden``).
        vocab: vocabulary size (embedding and lm_head rows).
        tied_embeddings: lm_head shares the embedding matrix (one copy of the weights in memory).
    """

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool = False

    def __post_init__(self) -> None:
        for f in ("hidden", "intermediate", "layers", "heads", "kv_heads", "head_dim", "vocab"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{f}: must be a positive int, got {v!r}")
        if self.heads % self.kv_heads:
            raise ValueError(
                f"kv_heads: heads ({self.heads}) must be divisible by kv_heads ({self.kv_heads})"
            )

    @property
    def group(self) -> int:
        """GQA group size: query heads per KV head."""
        return self.heads // self.kv_heads

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """Weight elements of one layer's linears: QKV, O, gate+up, down (norms are negligible)."""
        h, i = self.hidden, self.intermediate
        return h * (self.q_dim + 2 * self.kv_dim) + self.q_dim * h + 2 * h * i + i * h

    @property
    def lm_head_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def weight_elements(self) -> int:
        """Weight elements stored: layers' linears + embedding + (untied) lm_head."""
        emb = self.vocab * self.hidden
        return self.layers * self.layer_params + emb + (0 if self.tied_embeddings else emb)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV-cache bytes one token occupies over all layers: ``2 * layers * kv_heads * head_dim * bytes``."""
        return 2 * self.layers * self.kv_dim * dtype_bytes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _builtin_shapes() -> dict[str, ModelShape]:
    return {
        # HuggingFaceTB/SmolLM2-135M(-Instruct) config.json
        "smollm2-135m": ModelShape("smollm2-135m", 576, 1536, 30, 9, 3, 64, 49152, True),
        # meta-llama/Meta-Llama-3-8B config.json
        "llama-3-8b": ModelShape("llama-3-8b", 4096, 14336, 32, 32, 8, 128, 128256, False),
        # meta-llama/Meta-Llama-3-70B config.json
        "llama-3-70b": ModelShape("llama-3-70b", 8192, 28672, 80, 64, 8, 128, 128256, False),
        # mistralai/Mistral-7B-v0.1 config.json
        "mistral-7b": ModelShape("mistral-7b", 4096, 14336, 32, 32, 8, 128, 32000, False),
        # Qwen/Qwen3-0.6B config.json (head_dim 128, not hidden / heads)
        "qwen3-0.6b": ModelShape("qwen3-0.6b", 1024, 3072, 28, 16, 8, 128, 151936, True),
    }


_ALIASES: Mapping[str, str] = MappingProxyType(
    {
        "smollm2-135m-instruct": "smollm2-135m",
        "smollm2": "smollm2-135m",
        "llama-3.1-8b": "llama-3-8b",
        "llama3-8b": "llama-3-8b",
        "meta-llama-3-8b": "llama-3-8b",
        "llama-3.1-70b": "llama-3-70b",
        "llama3-70b": "llama-3-70b",
        "meta-llama-3-70b": "llama-3-70b",
        "mistral-7b-v0.1": "mistral-7b",
    }
)


def known_model_names() -> list[str]:
    """Built-in model shape names (aliases such as ``smollm2-135m-instruct`` are accepted too)."""
    return list(_builtin_shapes())


def model_shape_from_config(
    config: Mapping[str, Any], name: str = "custom", origin: str = "config"
) -> ModelShape:
    """A shape from a Hugging Face ``config.json`` dict (Llama/Mistral/Qwen-style key names).

    Raises:
        ValueError: naming the first missing field.
    """
    cfg = config
    if "hidden_size" not in cfg and isinstance(cfg.get("text_config"), Mapping):
        cfg = cfg["text_config"]  # multimodal wrappers keep the language model one level down
    for f in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if f not in cfg:
            raise ValueError(f"{origin}: config is missing required field {f!r}")
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    return ModelShape(
        name=name,
        hidden=hidden,
        intermediate=int(cfg["intermediate_size"]),
        layers=int(cfg["num_hidden_layers"]),
        heads=heads,
        kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        vocab=int(cfg["vocab_size"]),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


def get_model_shape(name_or_path: str | os.PathLike[str]) -> ModelShape:
    """A built-in shape by name, or the shape read from a ``config.json`` file or model directory.

    Raises:
        ValueError: unknown name (lists the known names) or a config missing a field.
    """
    s = os.fspath(name_or_path)
    p = Path(s)
    if p.is_dir() and (p / "config.json").is_file():
        p = p / "config.json"
    if p.is_file():
        try:
            cfg = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}: not valid JSON ({e})") from e
        if not isinstance(cfg, Mapping):
            raise ValueError(f"{p}: config must be a JSON object")
        label = p.parent.name if p.name == "config.json" and p.parent.name else p.stem
        return model_shape_from_config(cfg, name=label, origin=str(p))
    if s.endswith(".json"):
        raise ValueError(f"model: config file {s!r} does not exist")
    key = s.strip().lower().replace("_", "-")
    key = key.rsplit("/", 1)[-1]  # "meta-llama/Meta-Llama-3-8B" -> "meta-llama-3-8b"
    key = _ALIASES.get(key, key)
    shapes = _builtin_shapes()
    if key in shapes:
        return shapes[key]
    raise ValueError(
        f"model: unknown model {s!r}; known: {', '.join(known_model_names())} (or a config.json path)"
    )
