"""The one validated model config: shapes and options of a Llama-family decoder.

:class:`ModelConfig` covers Llama 2/3 (incl. Llama 3.1's ``"llama3"`` RoPE scaling), SmolLM2, Mistral
(sliding window) and Qwen2 (QKV bias). It is built from a Hugging Face ``config.json``
(:meth:`ModelConfig.from_hf_config`), from GGUF metadata (:mod:`flashpage.models.gguf_loader`) or
taken from :data:`BUILTIN_CONFIGS` for ``load_format="dummy"`` (random weights, for benchmarks).

RoPE scaling (``rope_scaling``, Hugging Face's dict form; ``"type"`` is accepted for ``"rope_type"``):

* ``None`` / ``{"rope_type": "default"}``: plain RoPE.
* ``{"rope_type": "linear", "factor": f}``: positions divided by ``f``.
* ``{"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
  "original_max_position_embeddings"}``: Llama 3.1's wavelength-dependent rescale.
* ``{"rope_type": "yarn", "factor", ["original_max_position_embeddings", "beta_fast", "beta_slow",
  "attention_factor", "mscale", "mscale_all_dim"]}``: YaRN (static; cos/sin scaled by the attention factor).
* ``{"rope_type": "freq_factors", "factors": (f_0, ...)}`` (flashpage's own): every inverse frequency
  ``i`` divided by ``f_i`` — llama.cpp's ``rope_freqs`` tensor, how GGUF files carry Llama 3.1 scaling.

``"dynamic"`` (NTK) is rejected: Hugging Face recomputes it from the running sequence length, which a
cos/sin table computed once per model cannot reproduce.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from types import MappingProxyType
from typing import Any

__all__ = [
    "BUILTIN_CONFIGS",
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_ROPE_TYPES",
    "ModelConfig",
    "get_builtin_config",
]

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "freq_factors")

# Keys each RoPE scaling type requires (beyond "rope_type").
_ROPE_REQUIRED: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor",),
    "freq_factors": ("factors",),
}

# Hugging Face model_type / architectures entry -> our architecture name.
_HF_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}
_HF_ARCH_CLASSES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
_HF_CLASS_OF = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}: must be a positive int, got {value!r}")


def _positive_float(name: str, value: Any) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"{name}: must be a positive finite number, got {value!r}")


def _normalize_rope_scaling(rs: Any) -> dict[str, Any] | None:
    """Validated copy of a HF-style rope scaling dict with ``rope_type`` set; ``None`` for plain RoPE."""
    if rs is None:
        return None
    if not isinstance(rs, dict):
        raise ValueError(f"rope_scaling: must be a dict or None, got {type(rs).__name__}")
    out = dict(rs)
    rope_type = out.pop("rope_type", None) or out.pop("type", None)
    out.pop("type", None)
    out.pop("rope_theta", None)  # transformers 5 `rope_parameters` carry the base here; it is rope_theta
    if rope_type is None:
        raise ValueError("rope_scaling: needs a 'rope_type' (or 'type') key")
    if rope_type == "dynamic":
        raise ValueError(
            "rope_scaling: 'dynamic' NTK scaling is not supported (it depends on the running sequence "
            f"length); supported rope types: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type not in _ROPE_REQUIRED:
        raise ValueError(
            f"rope_scaling: unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return None
    for key in _ROPE_REQUIRED[rope_type]:
        if key not in out:
            raise ValueError(f"rope_scaling: rope_type {rope_type!r} needs key {key!r}")
    if rope_type == "freq_factors":
        factors = tuple(float(f) for f in out["factors"])
        if not factors or any(not math.isfinite(f) or f <= 0 for f in factors):
            raise ValueError("rope_scaling: 'factors' must be a non-empty sequence of positive numbers")
        out["factors"] = factors
    else:
        _positive_float("rope_scaling.factor", out["factor"])
    if rope_type == "llama3":
        lo, hi = out["low_freq_factor"], out["high_freq_factor"]
        _positive_float("rope_scaling.low_freq_factor", lo)
        _positive_float("rope_scaling.high_freq_factor", hi)
        if hi <= lo:
            raise ValueError(f"rope_scaling: high_freq_factor ({hi}) must exceed low_freq_factor ({lo})")
        _positive_int(
            "rope_scaling.original_max_position_embeddings", out["original_max_position_embeddings"]
        )
    out["rope_type"] = rope_type
    return out


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and options of a Llama-family decoder-only transformer.

    Attributes:
        architecture: ``"llama"``, ``"mistral"`` or ``"qwen2"`` (the same compute graph; Mistral adds a
            sliding window, Qwen2 a bias on the Q/K/V projections).
        vocab_size, hidden_size, intermediate_size, num_layers: model dimensions.
        num_heads, num_kv_heads, head_dim: attention heads (GQA: ``num_heads % num_kv_heads == 0``);
            ``num_heads * head_dim`` need not equal ``hidden_size``.
        rms_norm_eps: RMSNorm epsilon.
        rope_theta: RoPE base.
        rope_scaling: Hugging Face style scaling dict (see the module docstring) or ``None``.
        max_position_embeddings: positions the cos/sin table covers (the longest sequence).
        tie_word_embeddings: the LM head is the embedding matrix.
        attention_bias: bias on the Q/K/V projections (Qwen2; Llama with ``attention_bias``).
        attention_out_bias: bias on the output projection (HF Llama's ``attention_bias`` adds both).
        sliding_window: each query sees only the last ``sliding_window`` keys (itself included).
        bos_token_id, eos_token_ids: special token ids (the engine stops on any of ``eos_token_ids``).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    attention_out_bias: bool = field(default=False)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture: {self.architecture!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in (
            "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
            "head_dim", "max_position_embeddings",
        ):  # fmt: skip
            _positive_int(name, getattr(self, name))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads: num_heads ({self.num_heads}) must be divisible by num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim: must be even for RoPE, got {self.head_dim}")
        _positive_float("rms_norm_eps", self.rms_norm_eps)
        _positive_float("rope_theta", self.rope_theta)
        rs = _normalize_rope_scaling(self.rope_scaling)
        if rs is not None and rs["rope_type"] == "freq_factors" and len(rs["factors"]) != self.head_dim // 2:
            raise ValueError(
                f"rope_scaling: 'factors' must have head_dim // 2 = {self.head_dim // 2} entries, "
                f"got {len(rs['factors'])}"
            )
        object.__setattr__(self, "rope_scaling", rs)
        if self.sliding_window is not None:
            _positive_int("sliding_window", self.sliding_window)
        for name in ("tie_word_embeddings", "attention_bias", "attention_out_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be a bool, got {getattr(self, name)!r}")
        if self.bos_token_id is not None and (
            not isinstance(self.bos_token_id, int) or not 0 <= self.bos_token_id < self.vocab_size
        ):
            raise ValueError(
                f"bos_token_id: must be None or in [0, {self.vocab_size}), got {self.bos_token_id!r}"
            )
        eos = self.eos_token_ids
        if isinstance(eos, int):
            eos = (eos,)
        try:
            eos = tuple(int(e) for e in eos)
        except (TypeError, ValueError):
            raise ValueError(
                f"eos_token_ids: must be a sequence of ints, got {self.eos_token_ids!r}"
            ) from None
        if any(not 0 <= e < self.vocab_size for e in eos):
            raise ValueError(f"eos_token_ids: every id must be in [0, {self.vocab_size}), got {eos}")
        object.__setattr__(self, "eos_token_ids", eos)

    # Frozen dataclasses hash their fields; rope_scaling is a dict, so hash a canonical form instead.
    def __hash__(self) -> int:
        d = asdict(self)
        d["rope_scaling"] = None if self.rope_scaling is None else tuple(sorted(self.rope_scaling.items()))
        return hash(tuple(d.items()))

    @property
    def q_size(self) -> int:
        """Width of the query projection, ``num_heads * head_dim``."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of each of the key and value projections, ``num_kv_heads * head_dim``."""
        return self.num_kv_heads * self.head_dim

    @property
    def window_size(self) -> tuple[int, int]:
        """flash-attn style ``(left, right)`` window: ``(sliding_window - 1, 0)`` or ``(-1, -1)``."""
        return (self.sliding_window - 1, 0) if self.sliding_window is not None else (-1, -1)

    def num_params(self) -> int:
        """Number of weight elements (embeddings, linears, norms, biases)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        attn += (self.q_size + 2 * self.kv_size) if self.attention_bias else 0
        attn += h if self.attention_out_bias else 0
        layer = attn + 3 * h * i + 2 * h
        return v * h * (1 if self.tie_word_embeddings else 2) + self.num_layers * layer + h

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed (validated again)."""
        d = asdict(self)
        d.update(changes)
        return ModelConfig(**d)

    @classmethod
    def from_hf_config(cls, d: dict) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dict (Llama, Mistral, Qwen2; transformers 4 or 5 keys).

        Raises:
            ValueError: unsupported ``model_type`` or option (names what is supported).
        """
        if not isinstance(d, dict):
            raise ValueError(f"config: must be a dict, got {type(d).__name__}")
        model_type = d.get("model_type")
        arch = _HF_MODEL_TYPES.get(model_type) if model_type is not None else None
        if arch is None and model_type is None:
            for cls_name in d.get("architectures") or ():
                arch = _HF_ARCH_CLASSES.get(cls_name)
                if arch:
                    break
        if arch is None:
            raise ValueError(
                f"config: model_type {model_type!r} (architectures {d.get('architectures')!r}) is not "
                f"supported; supported model_type: {', '.join(_HF_MODEL_TYPES)}"
            )
        for key in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        ):
            if key not in d:
                raise ValueError(f"config: missing required key {key!r}")
        if d.get("mlp_bias"):
            raise ValueError("config: mlp_bias=True is not supported (Llama-family MLPs without bias only)")
        if d.get("hidden_act", "silu") not in ("silu", "swish"):
            raise ValueError(f"config: hidden_act {d.get('hidden_act')!r} is not supported; supported: silu")
        heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // heads
        # transformers 5 folds rope_theta and the scaling into `rope_parameters`; 4.x has two keys.
        rope_params = d.get("rope_parameters") or {}
        if (
            isinstance(rope_params, dict)
            and "rope_theta" not in rope_params
            and any(isinstance(v, dict) for v in rope_params.values())
        ):
            raise ValueError("config: per-layer-type rope_parameters are not supported")
        rope_theta = d.get("rope_theta") or rope_params.get("rope_theta") or 10000.0
        rope_scaling = d.get("rope_scaling") or (rope_params if rope_params else None)
        if rope_params.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError("config: partial_rotary_factor != 1 is not supported")
        sliding_window = _hf_sliding_window(arch, d)
        eos = d.get("eos_token_id")
        eos_ids = () if eos is None else ((eos,) if isinstance(eos, int) else tuple(eos))
        if arch == "qwen2":
            qkv_bias, out_bias = True, False  # Qwen2 always has Q/K/V biases and none on o_proj
        else:
            qkv_bias = out_bias = bool(d.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=d.get("max_position_embeddings", 8192),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            attention_out_bias=out_bias,
            sliding_window=sliding_window,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The Hugging Face ``config.json`` dict for this config (loadable by transformers 4.x and 5.x)."""
        d: dict[str, Any] = {
            "architectures": [_HF_CLASS_OF[self.architecture]],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": (
                None if not self.eos_token_ids
                else self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids)
            ),
        }  # fmt: skip
        if self.rope_scaling is not None:
            if self.rope_scaling["rope_type"] == "freq_factors":
                raise ValueError(
                    "rope_scaling: 'freq_factors' (llama.cpp rope_freqs) has no Hugging Face form"
                )
            d["rope_scaling"] = dict(self.rope_scaling)
        if self.architecture == "qwen2":
            if not self.attention_bias or self.attention_out_bias:
                raise ValueError("attention_bias: Qwen2 in transformers has Q/K/V bias and no o_proj bias")
            d["use_sliding_window"] = self.sliding_window is not None
            d["sliding_window"] = self.sliding_window
            d["max_window_layers"] = 0
        else:
            if self.attention_bias != self.attention_out_bias:
                raise ValueError(
                    "attention_bias: transformers' Llama/Mistral put a bias on q/k/v and o_proj together"
                )
            d["attention_bias"] = self.attention_bias
            d["mlp_bias"] = False
            if self.architecture == "mistral":
                d["sliding_window"] = self.sliding_window
            elif self.sliding_window is not None:
                raise ValueError("sliding_window: transformers' Llama has no sliding window (use mistral)")
        return d


def _hf_sliding_window(arch: str, d: dict) -> int | None:
    """The uniform sliding window of a HF config, or ``None``; mixed per-layer windows are rejected."""
    if arch == "llama":
        return None
    window = d.get("sliding_window")
    layer_types = d.get("layer_types")
    if arch == "qwen2":
        if layer_types:
            kinds = set(layer_types)
        elif d.get("use_sliding_window"):
            # HF Qwen2: layers >= max_window_layers use the window.
            mwl = d.get("max_window_layers", 0)
            kinds = {"sliding_attention"} if mwl == 0 else {"full_attention", "sliding_attention"}
            if mwl >= d["num_hidden_layers"]:
                kinds = {"full_attention"}
        else:
            kinds = {"full_attention"}
        if kinds == {"full_attention"} or window is None:
            return None
        if kinds != {"sliding_attention"}:
            raise ValueError("config: Qwen2 with sliding window on only some layers is not supported")
        return int(window)
    return None if window is None else int(window)


_BUILTINS: dict[str, ModelConfig] = {
    # HuggingFaceTB/SmolLM2-135M-Instruct
    "smollm2-135m": ModelConfig(
        architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,),
    ),
    # meta-llama/Meta-Llama-3-8B(-Instruct): eos <|end_of_text|>, <|eot_id|>
    "llama-3-8b": ModelConfig(
        architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=8192, bos_token_id=128000, eos_token_ids=(128001, 128009),
    ),
    # meta-llama/Llama-3.1-8B: the same shapes with Llama 3.1's RoPE scaling and 128k positions
    "llama-3.1-8b": ModelConfig(
        architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        max_position_embeddings=131072, bos_token_id=128000, eos_token_ids=(128001, 128008, 128009),
    ),
    "llama-3-70b": ModelConfig(
        architecture="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80,
        num_heads=64, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=8192, bos_token_id=128000, eos_token_ids=(128001, 128009),
    ),
    # mistralai/Mistral-7B-v0.1 (4096-token sliding window)
    "mistral-7b": ModelConfig(
        architecture="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=32768, sliding_window=4096, bos_token_id=1, eos_token_ids=(2,),
    ),
    # Qwen/Qwen2-0.5B(-Instruct): eos <|endoftext|>, <|im_end|>
    "qwen2-0.5b": ModelConfig(
        architecture="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
        num_heads=14, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=32768, tie_word_embeddings=True, attention_bias=True,
        bos_token_id=151643, eos_token_ids=(151643, 151645),
    ),
}  # fmt: skip

BUILTIN_CONFIGS: MappingProxyType[str, ModelConfig] = MappingProxyType(_BUILTINS)
"""Read-only map of built-in model names to configs (figures from each model's HF ``config.json``)."""

# Names that resolve to a built-in config (the instruct variants share the base model's shapes).
_ALIASES = {
    "smollm2-135m-instruct": "smollm2-135m",
    "llama-3-8b-instruct": "llama-3-8b",
    "llama-3.1-8b-instruct": "llama-3.1-8b",
    "llama-3-70b-instruct": "llama-3-70b",
    "mistral-7b-v0.1": "mistral-7b",
    "qwen2-0.5b-instruct": "qwen2-0.5b",
}


def get_builtin_config(name: str) -> ModelConfig:
    """The built-in config for ``name`` (case-insensitive; instruct aliases accepted).

    Raises:
        ValueError: unknown name (lists the built-in names).
    """
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in BUILTIN_CONFIGS:
        raise ValueError(
            f"model: no built-in config named {name!r}; built-in: {', '.join(sorted(BUILTIN_CONFIGS))} "
            f"(aliases: {', '.join(sorted(_ALIASES))})"
        )
    return BUILTIN_CONFIGS[key]
