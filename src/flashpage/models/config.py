"""The one validated model config: shapes and options of a Llama-family decoder.

:class:`ModelConfig` covers Llama 2/3 (incl. Llama 3.1's ``"llama3"`` RoPE scaling), SmolLM2, Mistral
(sliding window), Qwen2 (QKV bias), Qwen3 (per-head q/k RMSNorm) and Gemma 2 / Gemma 3 (GeGLU MLP,
``1 + weight`` RMSNorm around both sub-blocks, scaled embeddings, logit softcaps, alternating
sliding-window / global layers, Gemma 3's q/k norms and local RoPE base). It is built from a Hugging Face ``config.json``
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
    "LAYER_TYPES",
    "SUPPORTED_ACTIVATIONS",
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_ROPE_TYPES",
    "ModelConfig",
    "get_builtin_config",
]

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")
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
_HF_MODEL_TYPES = {
    "llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
    "gemma3_text": "gemma3",
}  # fmt: skip
_HF_CLASS_OF = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
}  # fmt: skip
_HF_ARCH_CLASSES = {v: k for k, v in _HF_CLASS_OF.items()}
_HF_MODEL_TYPE_OF = {v: k for k, v in _HF_MODEL_TYPES.items()}
_GEMMA = ("gemma2", "gemma3")
# HF's default layer pattern: layer i is global when (i + 1) % period == 0 (Gemma 2: 1 in 2; Gemma 3: 1 in 6).
_GEMMA_SLIDING_PERIOD = {"gemma2": 2, "gemma3": 6}


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
        architecture: one of :data:`SUPPORTED_ARCHITECTURES`. All share one compute graph whose
            variations are the fields below (Mistral adds a sliding window, Qwen2 Q/K/V biases, Qwen3
            q/k norms; Gemma 2/3 set the Gemma options).
        vocab_size, hidden_size, intermediate_size, num_layers: model dimensions.
        num_heads, num_kv_heads, head_dim: attention heads (GQA: ``num_heads % num_kv_heads == 0``);
            ``num_heads * head_dim`` need not equal ``hidden_size``.
        rms_norm_eps: RMSNorm epsilon.
        rope_theta: RoPE base (of the global layers when ``rope_local_theta`` is set).
        rope_scaling: Hugging Face style scaling dict (see the module docstring) or ``None``; with
            ``rope_local_theta`` it applies to the global layers only (as Gemma 3 does).
        max_position_embeddings: positions the cos/sin table covers (the longest sequence).
        tie_word_embeddings: the LM head is the embedding matrix.
        attention_bias: bias on the Q/K/V projections (Qwen2; Llama with ``attention_bias``).
        attention_out_bias: bias on the output projection (HF Llama's ``attention_bias`` adds both).
        sliding_window: each query of a sliding layer sees only the last ``sliding_window`` keys
            (itself included).
        bos_token_id, eos_token_ids: special token ids (the engine stops on any of ``eos_token_ids``).
        layer_types: per layer ``"full_attention"`` or ``"sliding_attention"`` (Hugging Face's
            ``layer_types``); ``None``: with a ``sliding_window``, Gemma's pattern (Gemma 2: layer ``i``
            slides when ``(i + 1) % 2``, Gemma 3: when ``(i + 1) % 6``), every layer for the others.

        The next five default to ``None``, which takes the architecture's value (Gemma: GeGLU, offset 1,
        sandwich norms, scaled embeddings; Qwen3 and Gemma 3: q/k norms; Llama's otherwise).

        hidden_act: MLP activation of the gate, ``"silu"`` (SwiGLU) or ``"gelu_pytorch_tanh"`` (GeGLU).
        qk_norm: per-head RMSNorm of q and k (over ``head_dim``) before RoPE (Qwen3, Gemma 3).
        norm_weight_offset: RMSNorms scale by ``offset + weight``, multiplied in float32 before the
            cast (Gemma: 1.0, its weights are stored around 0); 0.0 is Llama's ``weight * x.to(dtype)``.
        sandwich_norm: Gemma's block: ``x + post_attn_norm(attn(norm(x)))`` then
            ``x + post_ffn_norm(mlp(pre_ffn_norm(x)))`` (four norms per layer instead of two).
        scale_embeddings: embeddings multiplied by ``sqrt(hidden_size)`` (rounded to the model dtype).
        query_pre_attn_scalar: softmax scale is ``query_pre_attn_scalar ** -0.5``; ``None``: ``head_dim``.
        attn_logit_softcapping: ``scores = cap * tanh(scores / cap)`` in every layer (Gemma 2), or ``None``.
        final_logit_softcapping: the same on the output logits (Gemma 2), or ``None``.
        rope_local_theta: RoPE base of the sliding layers, without scaling (Gemma 3), or ``None`` for
            one RoPE on every layer.
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
    layer_types: tuple[str, ...] | None = None
    hidden_act: str | None = None
    qk_norm: bool | None = None
    norm_weight_offset: float | None = None
    sandwich_norm: bool | None = None
    scale_embeddings: bool | None = None
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    rope_local_theta: float | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture: {self.architecture!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name, value in _arch_defaults(self.architecture).items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        if self.layer_types is None and self.sliding_window is not None and self.architecture in _GEMMA:
            period = _GEMMA_SLIDING_PERIOD[self.architecture]
            pattern = (
                "sliding_attention" if (i + 1) % period else "full_attention" for i in range(self.num_layers)
            )
            object.__setattr__(self, "layer_types", tuple(pattern))
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
        for name in ("tie_word_embeddings", "attention_bias", "attention_out_bias", "qk_norm", "sandwich_norm",
                     "scale_embeddings"):  # fmt: skip
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be a bool, got {getattr(self, name)!r}")
        self._validate_gemma_options()
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

    def _validate_gemma_options(self) -> None:
        """Validate (and normalise) the per-layer and Gemma fields."""
        if self.layer_types is not None:
            types = self.layer_types
            if isinstance(types, str) or not all(isinstance(t, str) for t in types):
                raise ValueError(f"layer_types: must be a sequence of strings, got {types!r}")
            types = tuple(types)
            if len(types) != self.num_layers:
                raise ValueError(
                    f"layer_types: needs {self.num_layers} entries (one per layer), got {len(types)}"
                )
            bad = sorted(set(types) - set(LAYER_TYPES))
            if bad:
                raise ValueError(f"layer_types: unknown {bad}; supported: {', '.join(LAYER_TYPES)}")
            if "sliding_attention" in types and self.sliding_window is None:
                raise ValueError("layer_types: sliding_attention layers need a sliding_window")
            object.__setattr__(self, "layer_types", types)
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(
                f"hidden_act: {self.hidden_act!r} is not supported; supported: {', '.join(SUPPORTED_ACTIVATIONS)}"
            )
        off = self.norm_weight_offset
        if isinstance(off, bool) or not isinstance(off, (int, float)) or not math.isfinite(off):
            raise ValueError(f"norm_weight_offset: must be a finite number, got {off!r}")
        object.__setattr__(self, "norm_weight_offset", float(off))
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                     "rope_local_theta"):  # fmt: skip
            if getattr(self, name) is not None:
                _positive_float(name, getattr(self, name))

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
        """flash-attn style ``(left, right)`` window of the sliding layers: ``(sliding_window - 1, 0)``,
        or ``(-1, -1)`` without a window."""
        return (self.sliding_window - 1, 0) if self.sliding_window is not None else (-1, -1)

    def is_sliding_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` attends through the sliding window."""
        if self.sliding_window is None:
            return False
        return self.layer_types is None or self.layer_types[layer] == "sliding_attention"

    def layer_window(self, layer: int) -> tuple[int, int]:
        """flash-attn style window of layer ``layer``: :attr:`window_size` on a sliding layer, else ``(-1, -1)``."""
        return self.window_size if self.is_sliding_layer(layer) else (-1, -1)

    @property
    def softmax_scale(self) -> float:
        """Attention scale: ``query_pre_attn_scalar ** -0.5`` (Gemma), else ``head_dim ** -0.5``."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def num_params(self) -> int:
        """Number of weight elements (embeddings, linears, norms, biases)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        attn += (self.q_size + 2 * self.kv_size) if self.attention_bias else 0
        attn += h if self.attention_out_bias else 0
        attn += 2 * self.head_dim if self.qk_norm else 0
        layer = attn + 3 * h * i + (4 if self.sandwich_norm else 2) * h
        return v * h * (1 if self.tie_word_embeddings else 2) + self.num_layers * layer + h

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed (validated again)."""
        d = asdict(self)
        d.update(changes)
        return ModelConfig(**d)

    @classmethod
    def from_hf_config(cls, d: dict) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dict (Llama, Mistral, Qwen2, Qwen3, Gemma 2, text-only
        Gemma 3; transformers 4 or 5 keys).

        Raises:
            ValueError: unsupported ``model_type`` or option (names what is supported).
        """
        if not isinstance(d, dict):
            raise ValueError(f"config: must be a dict, got {type(d).__name__}")
        if d.get("model_type") == "gemma3" and isinstance(d.get("text_config"), dict):
            return cls.from_hf_config(_gemma3_text_config(d))  # multimodal: its language model
        model_type = d.get("model_type")
        arch = _HF_MODEL_TYPES.get(model_type) if model_type is not None else None
        if arch is None and model_type is None:
            for cls_name in d.get("architectures") or ():
                arch = _HF_ARCH_CLASSES.get(cls_name)
                if arch:
                    break
        if arch is None:
            hint = " (a multimodal Gemma 3 config needs its 'text_config')" if model_type == "gemma3" else ""
            raise ValueError(
                f"config: model_type {model_type!r} (architectures {d.get('architectures')!r}) is not "
                f"supported; supported model_type: {', '.join(_HF_MODEL_TYPES)}{hint}"
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
        if d.get("use_bidirectional_attention"):
            raise ValueError("config: use_bidirectional_attention is not supported (causal decoders only)")
        gemma = arch in _GEMMA
        act = d.get("hidden_activation") if gemma else None
        act = act or d.get("hidden_act") or ("gelu_pytorch_tanh" if gemma else "silu")
        act = "silu" if act == "swish" else act
        if act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(
                f"config: hidden_act {act!r} is not supported; supported: {', '.join(SUPPORTED_ACTIVATIONS)}"
            )
        heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // heads
        rope_theta, rope_scaling, local_theta = _hf_rope(arch, d)
        if (d.get("rope_parameters") or {}).get(
            "partial_rotary_factor", d.get("partial_rotary_factor", 1.0)
        ) != 1.0:
            raise ValueError("config: partial_rotary_factor != 1 is not supported")
        sliding_window, layer_types = _hf_layer_types(arch, d)
        eos = d.get("eos_token_id")
        eos_ids = () if eos is None else ((eos,) if isinstance(eos, int) else tuple(eos))
        if arch == "qwen2":
            qkv_bias, out_bias = True, False  # Qwen2 always has Q/K/V biases and none on o_proj
        else:
            qkv_bias = out_bias = bool(d.get("attention_bias", False))
        gemma_opts: dict[str, Any] = {}
        if gemma:
            defaults = _HF_GEMMA_DEFAULTS[arch]
            gemma_opts = {k: d.get(k, v) for k, v in defaults.items()}
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6 if gemma else 1e-5)),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=d.get("max_position_embeddings", 8192),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", gemma)),
            attention_bias=qkv_bias,
            attention_out_bias=out_bias,
            sliding_window=sliding_window,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            layer_types=layer_types,
            hidden_act=act,
            rope_local_theta=local_theta,
            **gemma_opts,
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The Hugging Face ``config.json`` dict for this config (loadable by transformers 5.x; 4.x for
        Llama, Mistral and Qwen2).

        Raises:
            ValueError: an option the architecture's transformers class cannot express.
        """
        arch = self.architecture
        defaults = _arch_defaults(arch)
        for name, want in defaults.items():
            if getattr(self, name) != want:
                raise ValueError(f"{name}: transformers' {_HF_CLASS_OF[arch]} has {name}={want!r}")
        gemma = arch in _GEMMA
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
            if not gemma and getattr(self, name) is not None:
                raise ValueError(f"{name}: transformers' {_HF_CLASS_OF[arch]} has no {name}")
        if (self.rope_local_theta is not None) != (arch == "gemma3"):
            raise ValueError("rope_local_theta: only (and always) Gemma 3 has a local RoPE base")
        d: dict[str, Any] = {
            "architectures": [_HF_CLASS_OF[arch]],
            "model_type": _HF_MODEL_TYPE_OF[arch],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_activation" if gemma else "hidden_act": self.hidden_act,
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
        types = (
            list(self.layer_types)
            if self.layer_types is not None
            else ["sliding_attention" if self.sliding_window else "full_attention"] * self.num_layers
        )
        if arch == "gemma3":
            full = {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}
            local = {"rope_type": "default", "rope_theta": self.rope_local_theta}
            d["rope_parameters"] = {"full_attention": full, "sliding_attention": local}
            del d["rope_theta"], d["rope_scaling"]
        if gemma:
            d.update(
                query_pre_attn_scalar=self.query_pre_attn_scalar or self.head_dim,
                attn_logit_softcapping=self.attn_logit_softcapping,
                final_logit_softcapping=self.final_logit_softcapping,
                sliding_window=self.sliding_window,
                layer_types=types,
                attention_bias=self.attention_bias,
            )
        elif arch in ("qwen2", "qwen3"):
            if arch == "qwen2" and (not self.attention_bias or self.attention_out_bias):
                raise ValueError("attention_bias: Qwen2 in transformers has Q/K/V bias and no o_proj bias")
            d["use_sliding_window"] = self.sliding_window is not None
            d["sliding_window"] = self.sliding_window
            d["max_window_layers"] = 0
            if self.layer_types is not None:
                d["layer_types"] = types
        if not gemma and arch != "qwen2":
            if self.attention_bias != self.attention_out_bias:
                raise ValueError(
                    f"attention_bias: transformers' {_HF_CLASS_OF[arch]} puts a bias on q/k/v and o_proj together"
                )
            d["attention_bias"] = self.attention_bias
            d["mlp_bias"] = False
            if arch == "mistral":
                if self.layer_types is not None:
                    raise ValueError("layer_types: transformers' Mistral slides on every layer or none")
                d["sliding_window"] = self.sliding_window
            elif arch == "llama" and self.sliding_window is not None:
                raise ValueError("sliding_window: transformers' Llama has no sliding window (use mistral)")
        return d


# Options fixed by the architecture: ModelConfig fills them when left as None, to_hf_config checks them.
_LLAMA_DEFAULTS: dict[str, Any] = {
    "hidden_act": "silu", "qk_norm": False, "norm_weight_offset": 0.0, "sandwich_norm": False,
    "scale_embeddings": False,
}  # fmt: skip
_GEMMA_FLAGS: dict[str, Any] = {
    "hidden_act": "gelu_pytorch_tanh", "norm_weight_offset": 1.0, "sandwich_norm": True,
    "scale_embeddings": True,
}  # fmt: skip


def _arch_defaults(arch: str) -> dict[str, Any]:
    """The architecture-fixed options of ``arch`` (see ``_LLAMA_DEFAULTS``)."""
    if arch in _GEMMA:
        return {**_GEMMA_FLAGS, "qk_norm": arch == "gemma3"}
    return {**_LLAMA_DEFAULTS, "qk_norm": arch == "qwen3"}


# Gemma config.json keys and transformers' defaults for them.
_HF_GEMMA_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": {"query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    "gemma3": {"query_pre_attn_scalar": 256, "attn_logit_softcapping": None, "final_logit_softcapping": None},
}


# transformers' Gemma3TextConfig defaults: multimodal Gemma 3 configs (4B, 12B, 27B) list only the
# text_config keys that differ from them.
_GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0, "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1,
}  # fmt: skip


def _gemma3_text_config(d: dict) -> dict:
    """The language model's config of a multimodal Gemma 3 config: ``text_config`` over transformers'
    defaults, with the top-level special token ids (the chat end-of-turn id lives there)."""
    text = {**_GEMMA3_TEXT_DEFAULTS, **d["text_config"], "model_type": "gemma3_text"}
    for key in ("bos_token_id", "eos_token_id"):
        if d.get(key) is not None:
            text[key] = d[key]
    return text


def _hf_rope(arch: str, d: dict) -> tuple[float, Any, float | None]:
    """``(rope_theta, rope_scaling, rope_local_theta)`` of a HF config (transformers 4 or 5 keys)."""
    rope_params = d.get("rope_parameters") or {}
    per_layer = isinstance(rope_params, dict) and any(isinstance(v, dict) for v in rope_params.values())
    if arch == "gemma3":
        if per_layer:  # transformers 5: {"full_attention": {...}, "sliding_attention": {...}}
            full = dict(rope_params.get("full_attention") or {})
            local = dict(rope_params.get("sliding_attention") or {})
            if local.get("rope_type", "default") != "default":
                raise ValueError("config: a scaled RoPE on Gemma 3's sliding layers is not supported")
            theta = full.pop("rope_theta", None) or d.get("rope_theta") or 1_000_000.0
            local_theta = local.get("rope_theta") or d.get("rope_local_base_freq") or 10_000.0
            return theta, (full or None), float(local_theta)
        theta = rope_params.get("rope_theta") or d.get("rope_theta") or 1_000_000.0
        scaling = d.get("rope_scaling") or (rope_params if rope_params else None)
        return theta, scaling, float(d.get("rope_local_base_freq") or 10_000.0)
    if per_layer and "rope_theta" not in rope_params:
        raise ValueError("config: per-layer-type rope_parameters are not supported")
    # transformers 5 folds rope_theta and the scaling into `rope_parameters`; 4.x has two keys.
    theta = d.get("rope_theta") or rope_params.get("rope_theta") or 10000.0
    return theta, d.get("rope_scaling") or (rope_params if rope_params else None), None


def _hf_layer_types(arch: str, d: dict) -> tuple[int | None, tuple[str, ...] | None]:
    """``(sliding_window, layer_types)`` of a HF config, as transformers 5 resolves them."""
    if arch == "llama":
        return None, None
    n = d["num_hidden_layers"]
    window = d.get("sliding_window")
    types = d.get("layer_types")
    if arch in ("qwen2", "qwen3"):
        if not d.get("use_sliding_window"):
            return None, None  # HF drops the window unless use_sliding_window
        if types is None:  # HF Qwen: layers >= max_window_layers use the window
            mwl = d.get("max_window_layers", 0)
            types = ["sliding_attention" if i >= mwl else "full_attention" for i in range(n)]
    elif arch in _GEMMA and types is None:
        period = (
            d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or _GEMMA_SLIDING_PERIOD[arch]
        )
        types = ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(n)]
    if window is None or (types is not None and "sliding_attention" not in types):
        return None, None
    return int(window), (tuple(types) if types is not None else None)


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
    # Qwen/Qwen3-0.6B: head_dim 128 though hidden / heads is 64; eos <|im_end|>, <|endoftext|>
    "qwen3-0.6b": ModelConfig(
        architecture="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28,
        num_heads=16, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=40960, tie_word_embeddings=True, bos_token_id=151643,
        eos_token_ids=(151645, 151643),
    ),
    # google/gemma-2-2b: alternating 4096-token sliding / global layers, softcaps 50 (attention) and 30
    "gemma-2-2b": ModelConfig(
        architecture="gemma2", vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_layers=26,
        num_heads=8, num_kv_heads=4, head_dim=256, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=8192, tie_word_embeddings=True, sliding_window=4096,
        query_pre_attn_scalar=256, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        bos_token_id=2, eos_token_ids=(1, 107),
    ),
    # google/gemma-3-1b-it: 5 sliding (512 tokens, RoPE base 10k) : 1 global (base 1M); eos <eos>, <end_of_turn>
    "gemma-3-1b": ModelConfig(
        architecture="gemma3", vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_layers=26,
        num_heads=4, num_kv_heads=1, head_dim=256, rms_norm_eps=1e-6, rope_theta=1000000.0,
        rope_local_theta=10000.0, max_position_embeddings=32768, tie_word_embeddings=True,
        sliding_window=512, query_pre_attn_scalar=256, bos_token_id=2, eos_token_ids=(1, 106),
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
    "gemma-2-2b-it": "gemma-2-2b",
    "gemma-3-1b-it": "gemma-3-1b",
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
