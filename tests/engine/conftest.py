"""Session fixtures of the engine tests: models loaded once, the HF reference generated once.

* ``tiny_loaded``: a 2-layer random-weight Llama (``load_format="dummy"``), fast enough for
  randomized scheduler workloads.
* ``smollm``: the embedded SmolLM2-135M-Instruct GGUF loaded by flashpage (fp32, CPU).
* ``hf_greedy``: Hugging Face ``transformers`` greedy continuations (32 new tokens) of
  ``PARITY_PROMPTS`` from the same GGUF file, one prompt at a time, loaded offline once.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from flashpage.engine.sampling_params import SamplingParams

# Chat-formatted prompts (so the instruct model answers at length); three share a system prompt of
# more than two 16-token blocks to exercise the prefix cache.
_SYSTEM = (
    "<|im_start|>system\nYou are a helpful assistant for a geography quiz. Answer every question in "
    "two or three full sentences, and add one interesting fact about the place.<|im_end|>\n"
)


def _chat(question: str) -> str:
    return f"{_SYSTEM}<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


PARITY_PROMPTS: list[str] = [
    _chat("What is the capital of France?"),
    _chat("What is the largest ocean on Earth?"),
    _chat("Which river flows through Cairo?"),
    "The quick brown fox",
    "def fibonacci(n):",
]
PARITY_NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=PARITY_NEW_TOKENS)


def tiny_config(**changes: Any) -> Any:
    from flashpage.models.config import ModelConfig

    base = {
        "architecture": "llama",
        "vocab_size": 96,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_layers": 2,
        "num_heads": 2,
        "num_kv_heads": 1,
        "head_dim": 32,
        "max_position_embeddings": 512,
        "tie_word_embeddings": True,
        "eos_token_ids": (),
    }
    base.update(changes)
    return ModelConfig(**base)


@pytest.fixture(scope="session")
def tiny_loaded() -> Any:
    from flashpage.models.loader import load_model

    # On the GPU when there is one (the engine's CUDA path: graphs, pinned copies, Triton kernels).
    device = "cuda" if torch.cuda.is_available() else "cpu"
    loaded = load_model(
        "tiny", dtype=torch.float32, device=device, load_format="dummy", config=tiny_config(), seed=1
    )
    # Larger weights than the default N(0, 0.02) make the greedy continuation depend on the context
    # (with tiny weights it repeats one token), so the parity tests see attention bugs.
    loaded.model.init_random_(0.2, seed=1)
    return loaded


@pytest.fixture(scope="session")
def smollm() -> Any:
    from flashpage.models.loader import load_model

    return load_model("smollm2-135m-instruct", dtype=torch.float32, device="cpu")


@pytest.fixture(scope="session")
def parity_prompt_ids(smollm: Any) -> list[list[int]]:
    return [list(smollm.tokenizer.encode(p)) for p in PARITY_PROMPTS]


@pytest.fixture(scope="session")
def hf_greedy(parity_prompt_ids: list[list[int]]) -> list[list[int]]:
    """HF transformers greedy new tokens per parity prompt (stops at EOS like our engine)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    from flashpage.models.loader import embedded_model_path

    path = embedded_model_path("smollm2-135m-instruct")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32, local_files_only=True
    ).eval()
    eos = model.generation_config.eos_token_id
    outs: list[list[int]] = []
    with torch.inference_mode():
        for ids in parity_prompt_ids:
            x = torch.tensor([ids])
            y = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=PARITY_NEW_TOKENS,
                do_sample=False,
                pad_token_id=eos if isinstance(eos, int) else None,
            )
            outs.append(y[0, len(ids) :].tolist())
    del model
    return outs


@pytest.fixture(scope="session")
def tiny_tok(smollm: Any) -> Any:
    """A 2-layer random Llama with SmolLM2's vocabulary (49152, EOS 2), tokenizer and chat template:
    the text features (structured output, chat) at the speed of the tiny model."""
    import dataclasses

    from flashpage.models.loader import load_model

    cfg = tiny_config(vocab_size=smollm.config.vocab_size, eos_token_ids=tuple(smollm.config.eos_token_ids))
    device = "cuda" if torch.cuda.is_available() else "cpu"  # there the bitmask is applied on the GPU
    loaded = load_model(
        "tiny-tok", dtype=torch.float32, device=device, load_format="dummy", config=cfg, seed=2
    )
    loaded.model.init_random_(0.2, seed=2)
    return dataclasses.replace(loaded, tokenizer=smollm.tokenizer, chat_template=smollm.chat_template)
