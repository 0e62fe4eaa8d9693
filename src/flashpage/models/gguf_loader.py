"""Load a ``.gguf`` file (llama.cpp's format): metadata -> ModelConfig, tensors -> dequantised weights.

Header parsing is done here with ``struct`` over a memory map rather than with ``gguf.GGUFReader``:
the reader builds a numpy view per array element, which costs ~4 s for the 49k-token vocabulary and
49k merges of SmolLM2 alone, while this parser reads the same header in well under a second. The
``gguf`` package still provides the type table (block sizes) and the fallback dequantisers, and the
tests check this parser against ``GGUFReader`` field by field.

Dequantisation of the common formats (F32, F16, BF16, Q8_0, Q4_0, Q4_1) is done in PyTorch on the
target device (the raw blocks move, which is 4-8x fewer bytes than the float weights); every other
type the ``gguf`` package knows (K-quants, IQ*) goes through ``gguf.quants.dequantize`` in numpy.

llama.cpp stores Llama Q/K projection rows permuted for its interleaved ("GPT-J") RoPE; the loader
applies the inverse permutation (as transformers' GGUF loader does) so the model's non-interleaved
HF-convention RoPE applies. Qwen2/Qwen3 and Gemma files use NEOX RoPE and are not permuted.

Gemma files hold every RMSNorm weight as ``1 + w`` (llama.cpp's converter adds the one); the loader
subtracts it again, as transformers does. Gemma's ``query_pre_attn_scalar`` is not stored: it is
``attention.scale ** -2`` when the file has that key, else llama.cpp's rule (``hidden / heads`` for
the 27B models, ``head_dim`` for the others). Gemma 3's sliding layers rotate with base
``rope.freq_base_swa`` (10000 when absent, as llama.cpp hard-codes); the sliding pattern is
``attention.sliding_window_pattern`` or the architecture's (1 global layer in 2 / in 6).
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from flashpage.models.config import ModelConfig
from flashpage.models.llama import LlamaForCausalLM

__all__ = [
    "SUPPORTED_GGUF_ARCHITECTURES",
    "GGUFFile",
    "GGUFTensorInfo",
    "config_from_gguf",
    "dequantize",
    "dequantize_into",
    "hf_name_of",
    "load_gguf_weights",
    "read_gguf",
    "unpermute_qk",
]

SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3")

_GGUF_MAGIC = b"GGUF"
# Metadata value types (gguf spec): scalar struct formats; 8 = string, 9 = array.
_SCALAR_FMT = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_NUMPY_OF = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_STRING, _ARRAY = 8, 9

# ggml type ids (stable across gguf versions) handled natively in torch.
_F32, _F16, _Q4_0, _Q4_1, _Q8_0, _BF16 = 0, 1, 2, 3, 8, 30


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor of a GGUF file.

    Attributes:
        name: GGUF name (``blk.0.attn_q.weight``).
        shape: torch-order shape (GGUF lists dims fastest-first; this is reversed).
        ggml_type: ``gguf.GGMLQuantizationType`` value.
        offset: absolute byte offset of the data in the file.
        nbytes: size of the stored data.
    """

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int
    nbytes: int

    @property
    def type_name(self) -> str:
        import gguf

        return gguf.GGMLQuantizationType(self.ggml_type).name


@dataclass
class GGUFFile:
    """A parsed GGUF header: metadata and the tensor table (tensor data stays in the file).

    Attributes:
        path: the file.
        version: GGUF version (2 or 3).
        metadata: key -> value (strings decoded, arrays as lists).
        tensors: name -> info, in file order.
    """

    path: str
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]
    _map: np.ndarray | None = field(default=None, repr=False, compare=False)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def raw(self, name: str) -> np.ndarray:
        """The stored bytes of tensor ``name``: a uint8 view of one copy-on-write memory map of the file.

        Copy-on-write ("c") so ``torch.from_numpy`` gets a writable array; nothing is ever written back.
        """
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="c")
        info = self.tensors[name]
        return self._map[info.offset : info.offset + info.nbytes]


class _Cursor:
    """Little-endian reader over a bytes-like buffer."""

    def __init__(self, buf: Any, path: str) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def scalar(self, fmt: str) -> Any:
        try:
            (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        except struct.error:
            raise ValueError(f"{self.path}: truncated GGUF header at byte {self.pos}") from None
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.scalar("<Q")
        end = self.pos + n
        if end > len(self.buf):
            raise ValueError(f"{self.path}: truncated GGUF string at byte {self.pos}")
        s = bytes(self.buf[self.pos : end]).decode("utf-8", errors="replace")
        self.pos = end
        return s

    def value(self, vtype: int) -> Any:
        if vtype in _SCALAR_FMT:
            return self.scalar(_SCALAR_FMT[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype, count = self.scalar("<I"), self.scalar("<Q")
            if itype in _NUMPY_OF:  # numeric arrays in one numpy read
                dt = np.dtype(_NUMPY_OF[itype])
                arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos)
                self.pos += dt.itemsize * count
                return arr.tolist()
            if itype == _STRING:
                return self._string_array(count)
            return [self.value(itype) for _ in range(count)]
        raise ValueError(f"{self.path}: unknown GGUF metadata value type {vtype} at byte {self.pos}")

    def _string_array(self, count: int) -> list[str]:
        # The hot loop of the header (vocabularies, merges): local names, no method calls per element.
        buf, pos, unpack = self.buf, self.pos, struct.Struct("<Q").unpack_from
        out = []
        append = out.append
        for _ in range(count):
            (n,) = unpack(buf, pos)
            pos += 8
            append(str(buf[pos : pos + n], "utf-8", "replace"))
            pos += n
        if pos > len(buf):
            raise ValueError(f"{self.path}: truncated GGUF string array")
        self.pos = pos
        return out


def read_gguf(path: str) -> GGUFFile:
    """Parse a GGUF file's header (metadata and tensor table) without reading tensor data.

    Raises:
        ValueError: not a GGUF file, unsupported version, or a truncated header.
    """
    import gguf

    if not os.path.isfile(path):
        raise ValueError(f"model: GGUF file not found: {path}")
    with open(path, "rb") as f:
        if f.read(4) != _GGUF_MAGIC:
            raise ValueError(f"{path}: not a GGUF file (bad magic)")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        cur = _Cursor(mm, path)
        cur.pos = 4
        version = cur.scalar("<I")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            metadata[key] = cur.value(cur.scalar("<I"))
        entries = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.scalar("<I")
            dims = [cur.scalar("<Q") for _ in range(n_dims)]
            entries.append((name, tuple(reversed(dims)), cur.scalar("<I"), cur.scalar("<Q")))
        alignment = int(metadata.get("general.alignment", 32))
        data_start = (cur.pos + alignment - 1) // alignment * alignment
        size = len(mm)
    finally:
        mm.close()
    tensors: dict[str, GGUFTensorInfo] = {}
    for name, shape, ggml_type, rel in entries:
        try:
            qtype = gguf.GGMLQuantizationType(ggml_type)
        except ValueError:
            raise ValueError(f"{path}: tensor {name!r} has unknown ggml type {ggml_type}") from None
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        n = int(np.prod(shape)) if shape else 1
        if shape and shape[-1] % block:
            raise ValueError(
                f"{path}: tensor {name!r} row of {shape[-1]} is not a multiple of {block} ({qtype.name})"
            )
        nbytes = n // block * type_size
        info = GGUFTensorInfo(name, shape, ggml_type, data_start + rel, nbytes)
        if info.offset + nbytes > size:
            raise ValueError(f"{path}: tensor {name!r} runs past the end of the file (truncated download?)")
        tensors[name] = info
    return GGUFFile(path=path, version=version, metadata=metadata, tensors=tensors)


# ----------------------------------------------------------------------------------------------------------
# Dequantisation
# ----------------------------------------------------------------------------------------------------------


def _f16_col(blocks: Tensor, start: int) -> Tensor:
    """Column pair ``start:start+2`` of uint8 ``blocks (n, bytes)`` read as one float16 per row -> float32 ``(n, 1)``."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _unpack_nibbles(qs: Tensor) -> Tensor:
    """ggml's 4-bit packing, ``qs (n, 16)`` uint8 -> ``(n, 32)`` uint8: byte ``j`` holds element ``j``
    (low nibble) and ``j + 16`` (high nibble). Written with ``out=`` so only one buffer is allocated."""
    buf = torch.empty(qs.shape[0], 32, dtype=torch.uint8, device=qs.device)
    torch.bitwise_and(qs, 0x0F, out=buf[:, :16])
    torch.bitwise_right_shift(qs, 4, out=buf[:, 16:])
    return buf


def dequantize_into(raw: Tensor, ggml_type: int, out: Tensor) -> Tensor:
    """Dequantise the stored bytes of one tensor into ``out`` (any float dtype, on ``raw``'s device).

    The common formats are written straight into ``out`` when it is contiguous float32, with the same
    float32 operation order as ``gguf.quants`` (so results are bit-identical to it); large temporaries
    are avoided because every fresh allocation page-faults (the load is bound by memory traffic).

    Args:
        raw: ``(nbytes,)`` uint8 stored data.
        ggml_type: ``gguf.GGMLQuantizationType`` value.
        out: destination with the tensor's torch-order shape.
    Returns:
        ``out``.
    """
    direct = out.dtype == torch.float32 and out.is_contiguous()
    if ggml_type in (_F32, _F16, _BF16):
        src = raw.view({_F32: torch.float32, _F16: torch.float16, _BF16: torch.bfloat16}[ggml_type])
        return out.copy_(src.view(out.shape))
    if ggml_type not in (_Q8_0, _Q4_0, _Q4_1):
        return out.copy_(dequantize(raw, ggml_type, tuple(out.shape), torch.float32))
    dest = (
        out.view(-1, 32)
        if direct
        else torch.empty(out.numel() // 32, 32, dtype=torch.float32, device=raw.device)
    )
    if ggml_type == _Q8_0:  # 32 weights: f16 scale d, 32 x int8 q; w = d * q
        b = raw.view(-1, 34)
        torch.mul(b[:, 2:].view(torch.int8), _f16_col(b, 0), out=dest)
    elif ggml_type == _Q4_0:  # 32 weights: f16 d, 16 bytes of nibbles; w = d * (q - 8)
        b = raw.view(-1, 18)
        q = _unpack_nibbles(b[:, 2:]).view(torch.int8).sub_(8)  # exact in int8: -8..7
        torch.mul(q, _f16_col(b, 0), out=dest)
    else:  # Q4_1 — 32 weights: f16 d, f16 m, 16 bytes of nibbles; w = d * q + m
        b = raw.view(-1, 20)
        torch.mul(_unpack_nibbles(b[:, 4:]), _f16_col(b, 0), out=dest)
        dest.add_(_f16_col(b, 2))
    if not direct:
        out.copy_(dest.view(out.shape))
    return out


def dequantize(
    raw: Tensor | np.ndarray, ggml_type: int, shape: tuple[int, ...], dtype: torch.dtype
) -> Tensor:
    """Dequantise the stored bytes of one tensor to a new ``shape`` tensor in ``dtype`` on ``raw``'s device.

    Args:
        raw: ``(nbytes,)`` uint8 stored data (torch tensor on any device, or numpy on CPU).
        ggml_type: ``gguf.GGMLQuantizationType`` value (types beyond F32/F16/BF16/Q8_0/Q4_0/Q4_1 go through
            ``gguf.quants.dequantize`` in numpy).
        shape: torch-order shape of the result.
        dtype: result dtype (computation is float32).
    """
    if isinstance(raw, np.ndarray):
        raw = torch.from_numpy(raw)
    if ggml_type in (_F32, _F16, _BF16, _Q8_0, _Q4_0, _Q4_1):
        out = torch.empty(shape, dtype=torch.float32, device=raw.device)
        return dequantize_into(raw, ggml_type, out).to(dtype)
    import gguf

    qtype = gguf.GGMLQuantizationType(ggml_type)
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    # gguf's numpy dequantisers take (rows, bytes per row) and return (rows, elements per row).
    arr = gguf.quants.dequantize(raw.cpu().numpy().reshape(rows, -1), qtype)
    return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).reshape(shape).to(raw.device, dtype)


def unpermute_qk(w: Tensor, n_head: int) -> Tensor:
    """Undo llama.cpp's Q/K row permutation (``convert_hf_to_gguf.py`` ``LlamaModel.permute``).

    llama.cpp reorders each head's rows from ``[first half, second half]`` to interleaved pairs; this
    maps ``(n_head * head_dim, ...)`` rows back (the same as transformers' ``_reverse_permute_weights``).
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# ----------------------------------------------------------------------------------------------------------
# Config and names
# ----------------------------------------------------------------------------------------------------------

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Gemma's four norms per layer: ffn_norm is the pre-MLP norm there, post_attention_norm the norm of the
# attention output (HF's post_attention_layernorm, which in Llama is the pre-MLP norm).
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_GEMMA_ARCHS = ("gemma2", "gemma3")
_GEMMA_SLIDING_PERIOD = {"gemma2": 2, "gemma3": 6}
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_ROPE_FREQS = "rope_freqs.weight"


def hf_name_of(gguf_name: str, architecture: str = "llama") -> str | None:
    """The Hugging Face tensor name of a GGUF tensor name (of a file of GGUF ``architecture``), or
    ``None`` if it is not a model weight."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _GEMMA_LAYER_NAMES if architecture in _GEMMA_ARCHS else _LAYER_NAMES
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}"
    return None


def config_from_gguf(gf: GGUFFile) -> ModelConfig:
    """Build the ModelConfig from GGUF metadata (``{arch}.*`` keys and ``tokenizer.ggml.*`` ids).

    Raises:
        ValueError: unsupported architecture or option (names what is supported).
    """
    md = gf.metadata
    arch = gf.architecture
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"{gf.path}: GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)} (Mistral files use 'llama')"
        )

    def key(name: str, default: Any = None, required: bool = False) -> Any:
        full = f"{arch}.{name}"
        if full not in md:
            if required:
                raise ValueError(f"{gf.path}: GGUF metadata lacks {full!r}")
            return default
        return md[full]

    hidden = int(key("embedding_length", required=True))
    heads = int(key("attention.head_count", required=True))
    kv_heads = key("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # some files store one count per layer
        if len(set(kv_heads)) != 1:
            raise ValueError(f"{gf.path}: per-layer KV head counts are not supported")
        kv_heads = kv_heads[0]
    head_dim = int(key("attention.key_length", hidden // heads))
    rot_dim = key("rope.dimension_count", head_dim)
    if int(rot_dim) != head_dim:
        raise ValueError(
            f"{gf.path}: partial rotary (rope.dimension_count {rot_dim} != head_dim {head_dim}) is not supported"
        )
    vocab = key("vocab_size")
    if vocab is None:
        tokens = md.get("tokenizer.ggml.tokens")
        vocab = len(tokens) if tokens is not None else gf.tensors["token_embd.weight"].shape[0]
    max_pos = int(key("context_length", 8192))
    rope_scaling: dict[str, Any] | None = None
    scaling_type = key("rope.scaling.type")
    if scaling_type not in (None, "none"):
        factor = key("rope.scaling.factor", 1.0)
        rope_scaling = {"rope_type": scaling_type, "factor": float(factor)}
        orig = key("rope.scaling.original_context_length")
        if orig is not None:
            rope_scaling["original_max_position_embeddings"] = int(orig)
    if _ROPE_FREQS in gf.tensors:  # Llama 3.1 files: per-frequency divisors instead of scaling keys
        info = gf.tensors[_ROPE_FREQS]
        factors = dequantize(gf.raw(_ROPE_FREQS), info.ggml_type, info.shape, torch.float32)
        rope_scaling = {"rope_type": "freq_factors", "factors": tuple(factors.tolist())}
    eos_ids = [
        md[k]
        for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        if k in md
    ]
    window = key("attention.sliding_window")
    name = str(md.get("general.name", "")).lower()
    architecture = arch if arch != "llama" else ("mistral" if "mistral" in name else "llama")
    layers = int(key("block_count", required=True))
    extra: dict[str, Any] = {}
    if arch in _GEMMA_ARCHS:
        extra = _gemma_options(gf, arch, key, hidden, heads, head_dim, layers, window)
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length", required=True)),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=max_pos,
        tie_word_embeddings="output.weight" not in gf.tensors,
        attention_bias="blk.0.attn_q.bias" in gf.tensors,
        attention_out_bias="blk.0.attn_output.bias" in gf.tensors,
        sliding_window=int(window) if window else None,
        bos_token_id=int(md["tokenizer.ggml.bos_token_id"]) if "tokenizer.ggml.bos_token_id" in md else None,
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos_ids)),
        qk_norm="blk.0.attn_q_norm.weight" in gf.tensors,
        **extra,
    )


def _gemma_options(
    gf: GGUFFile, arch: str, key: Any, hidden: int, heads: int, head_dim: int, layers: int, window: Any
) -> dict[str, Any]:
    """Gemma 2/3 config fields from GGUF metadata (see the module docstring for the inferred ones)."""
    scale = key("attention.scale")
    if scale is not None:
        qpas = float(scale) ** -2
    elif layers == _GEMMA_27B_LAYERS[arch]:
        qpas = float(hidden // heads)
    else:
        qpas = float(head_dim)
    out: dict[str, Any] = {
        "query_pre_attn_scalar": qpas,
        "attn_logit_softcapping": key("attn_logit_softcapping"),
        "final_logit_softcapping": key("final_logit_softcapping"),
    }
    if window:
        pattern = key("attention.sliding_window_pattern", _GEMMA_SLIDING_PERIOD[arch])
        if isinstance(pattern, list):  # llama.cpp: one bool per layer, True = sliding
            if len(pattern) != layers:
                raise ValueError(f"{gf.path}: attention.sliding_window_pattern needs {layers} entries")
            sliding = [bool(p) for p in pattern]
        else:
            sliding = [bool((i + 1) % int(pattern)) for i in range(layers)]
        out["layer_types"] = tuple("sliding_attention" if s else "full_attention" for s in sliding)
    if arch == "gemma3":
        out["rope_local_theta"] = float(key("rope.freq_base_swa", 10000.0))
    return out


@contextmanager
def _single_thread_on_cpu(device: torch.device) -> Iterator[None]:
    """Run CPU dequantisation on one intra-op thread, restoring the setting afterwards.

    The ~1000 small elementwise ops of a load are memory-bound; with two OpenMP threads each op ends
    in a barrier, and on a machine whose cores are busy with other work a descheduled thread stalls
    every barrier: measured 3.5-8 s with 2 threads vs 0.3-0.4 s with 1 for SmolLM2 on 2 shared cores.
    """
    if device.type != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@torch.no_grad()
def load_gguf_weights(model: LlamaForCausalLM, gf: GGUFFile) -> None:
    """Dequantise every tensor of ``gf`` into ``model``'s parameters (on their device, in their dtype).

    The raw blocks move to the model's device and dequantise there, straight into the parameter slices;
    llama Q/K rows are un-permuted on the way.

    Raises:
        ValueError: a tensor the model does not know, a shape mismatch, or a missing tensor.
    """
    slots = model.weight_slots()
    config = model.config
    # rope_freqs went into the config; output.weight of a tied model is the embedding again.
    skip = {_ROPE_FREQS, "output.weight"} if config.tie_word_embeddings else {_ROPE_FREQS}
    unknown = [n for n in gf.tensors if n not in skip and hf_name_of(n, gf.architecture) not in slots]
    if unknown:
        raise ValueError(f"{gf.path}: unexpected tensors for a {gf.architecture} model: {unknown[:5]}")
    permuted = gf.architecture == "llama"  # llama.cpp permutes Q/K for its interleaved rope
    loaded: set[str] = set()
    with _single_thread_on_cpu(model.device):
        _dequantize_all(gf, slots, skip, permuted, config, loaded)
    missing = [n for n in slots if n not in loaded]
    if missing:
        raise ValueError(f"{gf.path}: the file lacks tensors the model needs: {missing[:5]}")


def _dequantize_all(
    gf: GGUFFile,
    slots: dict[str, Tensor],
    skip: set[str],
    permuted: bool,
    config: ModelConfig,
    loaded: set[str],
) -> None:
    """The loop of :func:`load_gguf_weights` (names already checked); adds each HF name to ``loaded``."""
    for name, info in gf.tensors.items():
        if name in skip:
            continue
        hf = hf_name_of(name, gf.architecture)
        assert hf is not None  # unknown names were rejected before
        dest = slots[hf]
        if tuple(dest.shape) != info.shape:
            raise ValueError(
                f"{gf.path}: tensor {name!r} has shape {info.shape}, expected {tuple(dest.shape)}"
            )
        raw = torch.from_numpy(gf.raw(name)).to(dest.device)
        if permuted and (".attn_q." in name or ".attn_k." in name):
            n_head = config.num_heads if ".attn_q." in name else config.num_kv_heads
            dest.copy_(unpermute_qk(dequantize(raw, info.ggml_type, info.shape, torch.float32), n_head))
        else:
            dequantize_into(raw, info.ggml_type, dest)
        if gf.architecture in _GEMMA_ARCHS and name.endswith("norm.weight"):
            dest.sub_(1.0)  # llama.cpp stores Gemma's norm weights as 1 + w
        loaded.add(hf)
