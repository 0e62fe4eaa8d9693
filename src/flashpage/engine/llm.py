"""``LLM``: the vLLM-style offline API over :class:`~flashpage.engine.engine_core.EngineCore`.

::

    from flashpage import LLM, SamplingParams
    llm = LLM(model="smollm2-135m-instruct")
    outs = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=32))
    llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=16))
    llm.stats()

``generate`` and ``chat`` may be called from several threads at once: their requests share the
running batch, and whichever call is stepping the engine hands the other calls their outputs.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence as Seq
from typing import Any

import torch

from flashpage.engine.engine_core import EngineConfig, EngineCore
from flashpage.engine.outputs import RequestOutput
from flashpage.engine.sampling_params import SamplingParams

__all__ = ["LLM"]

PromptInput = str | list[int] | dict[str, Any]


def _is_token_list(x: Any) -> bool:
    return (
        isinstance(x, list | tuple)
        and len(x) > 0
        and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
    )


class LLM:
    """An offline inference engine for one model.

    Args:
        model: built-in name (default the embedded ``smollm2-135m-instruct``), HF directory, ``.gguf``
            file, a built-in config name with ``load_format="dummy"``, or an object returned by
            ``flashpage.models.loader.load_model``.
        dtype: ``"auto"`` (a loaded model's own, else bf16 on GPU, fp32 on CPU), ``"bfloat16"``,
            ``"float16"``, ``"float32"``.
        block_size: tokens per KV block.
        max_num_seqs: most sequences per step.
        max_num_batched_tokens: token budget per step (chunked prefill); default 8192 GPU / 2048 CPU.
        enable_prefix_caching: reuse KV blocks of shared prompt prefixes.
        gpu_memory_utilization: fraction of GPU memory to use.
        kv_cache_bytes: explicit KV cache size (bytes).
        seed: seed of sampling without per-request seeds (and of dummy weights).
        device: ``None`` = a loaded model's own, else cuda if available, else cpu.
        load_format: ``auto`` | ``safetensors`` | ``gguf`` | ``dummy``.
        enforce_eager: disable CUDA graphs.
        max_model_len: longest sequence (prompt + output); default the model's context capped to what
            the KV cache holds; an explicit value the cache cannot hold is an error.
        model_config: config for ``load_format="dummy"`` (ModelConfig or HF config dict).
        tensor_parallel_size: split the model over this many ranks (GPUs; processes on CPU), spawned by
            the engine or launched by ``torchrun`` (see :mod:`flashpage.engine.tp_workers`);
            ``model`` must then be a name or path.
    Raises:
        ValueError: a bad option (naming it) or a model that cannot be loaded.
    """

    def __init__(
        self,
        model: Any = "smollm2-135m-instruct",
        dtype: str | torch.dtype = "auto",
        block_size: int = 16,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        enable_prefix_caching: bool = True,
        gpu_memory_utilization: float = 0.9,
        kv_cache_bytes: int | None = None,
        seed: int = 0,
        device: str | torch.device | None = None,
        load_format: str = "auto",
        enforce_eager: bool = False,
        max_model_len: int | None = None,
        model_config: Any = None,
        tensor_parallel_size: int = 1,
    ) -> None:
        config = EngineConfig(
            model=model,
            dtype=dtype,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching,
            gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_bytes=kv_cache_bytes,
            seed=seed,
            device=device,
            load_format=load_format,
            enforce_eager=enforce_eager,
            max_model_len=max_model_len,
            model_config=model_config,
            tensor_parallel_size=tensor_parallel_size,
        )
        self.engine = EngineCore(config)
        self._ids = itertools.count()
        # Concurrent generate() calls: one steps the engine at a time (under _cond's lock only to
        # hand over), finished outputs are parked in _done for the call that owns them.
        self._cond = threading.Condition()
        self._stepping = False
        self._done: dict[str, RequestOutput] = {}

    # ------------------------------------------------------------------ helpers

    def get_tokenizer(self) -> Any:
        """The model's tokenizer (``None`` for dummy weights)."""
        return self.engine.tokenizer

    @staticmethod
    def _normalize_prompts(prompts: Any) -> list[PromptInput]:
        if isinstance(prompts, str | dict) or _is_token_list(prompts):
            return [prompts]
        if isinstance(prompts, torch.Tensor):
            if prompts.dim() == 1:
                return [prompts.tolist()]
            if prompts.dim() == 2:
                return [list(r) for r in prompts.tolist()]
            raise ValueError(f"prompts: a tensor of token ids must be 1-D or 2-D, got {tuple(prompts.shape)}")
        if isinstance(prompts, list | tuple):
            out: list[PromptInput] = []
            for i, p in enumerate(prompts):
                if isinstance(p, torch.Tensor):
                    p = p.tolist()
                if not (isinstance(p, str | dict) or _is_token_list(p)):
                    raise ValueError(
                        f"prompts[{i}]: expected a string, a list of token ids or a dict, got {p!r}"
                    )
                out.append(p)
            return out
        raise ValueError(
            f"prompts: expected a string, token ids or a list of them, got {type(prompts).__name__}"
        )

    @staticmethod
    def _normalize_params(
        sampling_params: SamplingParams | Seq[SamplingParams] | None, n: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        params = list(sampling_params)
        if len(params) != n:
            raise ValueError(f"sampling_params: got {len(params)} for {n} prompts")
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise ValueError(f"sampling_params[{i}]: expected SamplingParams, got {type(p).__name__}")
        return params

    def _add(self, prompt: PromptInput, params: SamplingParams) -> str:
        rid = f"llm-{next(self._ids)}"
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                self.engine.add_request(
                    rid,
                    prompt.get("prompt"),
                    params,
                    prompt_token_ids=list(prompt["prompt_token_ids"]),
                    stream=False,
                )
            elif "prompt" in prompt:
                self.engine.add_request(rid, prompt["prompt"], params, stream=False)
            else:
                raise ValueError("prompts: a dict prompt needs 'prompt' or 'prompt_token_ids'")
        else:
            self.engine.add_request(rid, prompt, params, stream=False)
        return rid

    # ------------------------------------------------------------------ API

    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate completions for every prompt (all batched together, continuous batching).

        Args:
            prompts: a string, a list of token ids, a ``{"prompt"| "prompt_token_ids": ...}`` dict, or
                a list of those (a 2-D tensor of token ids is accepted too).
            sampling_params: one for all prompts, one per prompt, or ``None`` (defaults).
            use_tqdm: show a progress bar (finished requests).
        Returns:
            One finished :class:`RequestOutput` per prompt, in prompt order.
        """
        items = self._normalize_prompts(prompts)
        params = self._normalize_params(sampling_params, len(items))
        ids: list[str] = []
        try:
            for p, sp in zip(items, params):
                ids.append(self._add(p, sp))
        except Exception:
            self.engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        """Step the engine (or wait while another call steps it) until every request of ``ids`` is done."""
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(ids) > 1:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        cond = self._cond
        try:
            with cond:
                while True:
                    for i in ids:
                        if i not in done and i in self._done:
                            done[i] = self._done.pop(i)
                            if bar is not None:
                                bar.update(1)
                    if len(done) == len(ids):
                        break
                    if self._stepping:
                        cond.wait()  # the stepping call notifies after each step
                        continue
                    self._stepping = True
                    cond.release()
                    try:
                        outs = self.engine.step()
                    finally:
                        cond.acquire()
                        self._stepping = False
                        cond.notify_all()
                    for o in outs:
                        if o.finished:
                            self._done[o.request_id] = o
                    if (
                        not outs
                        and not self.engine.has_unfinished()
                        and not any(i in self._done for i in ids)
                    ):
                        break
        except BaseException:
            self.engine.abort_request([i for i in ids if i not in done])
            with cond:
                for i in ids:
                    self._done.pop(i, None)
            raise
        finally:
            if bar is not None:
                bar.close()
        missing = [i for i in ids if i not in done]
        if missing:
            raise RuntimeError(f"engine stopped with {len(missing)} unfinished requests")
        return [done[i] for i in ids]

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """The chat prompt text of one conversation (see :meth:`EngineCore.render_chat`)."""
        return self.engine.render_chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template,
            continue_final_message=continue_final_message,
        )[0]

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (list of ``{"role", "content"}``) or a list of them.

        Args:
            messages: a conversation or a list of conversations; ``content`` is a string or a list of
                ``{"type": "text", "text": ...}`` parts.
            sampling_params: as for :meth:`generate`.
            use_tqdm: show a progress bar.
            add_generation_prompt: open an assistant turn after the messages.
            chat_template: a Jinja chat template instead of the model's.
            continue_final_message: continue the last (assistant) message instead of starting a new
                turn; exclusive with ``add_generation_prompt`` (pass ``add_generation_prompt=False``).
        Raises:
            ValueError: ``"messages[i]: ..."`` for a bad message, both flags set, a bad template.
        """
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages: expected a non-empty list of messages or of conversations")
        convs = [messages] if not isinstance(messages[0], list) else messages
        prompts: list[PromptInput] = []
        for conv in convs:
            text, ids = self.engine.render_chat(
                conv,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
                continue_final_message=continue_final_message,
            )
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def stats(self) -> dict[str, Any]:
        """KV blocks total/used, waste %, prefix-cache hit rate, tokens/s, TTFT and the roofline
        decision per phase (see :meth:`EngineCore.stats`)."""
        return self.engine.stats()

    def reset_stats(self) -> None:
        """Zero the throughput and latency counters."""
        self.engine.reset_stats()

    def close(self) -> None:
        """Release the KV cache and CUDA graphs, and stop the tensor-parallel ranks."""
        self.engine.close()
