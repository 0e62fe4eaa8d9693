"""The engine core: requests in, incremental outputs out, one model step at a time.

:class:`EngineCore` is what both the offline :class:`~flashpage.engine.llm.LLM` and the OpenAI server
drive::

    core = EngineCore(EngineConfig(model="smollm2-135m-instruct"))
    core.add_request("r1", "Hello", SamplingParams(max_tokens=8), stream=True)
    while core.has_unfinished():
        for out in core.step():          # RequestOutput snapshots with delta_text / delta_token_ids
            ...

Threading: ``add_request`` and ``abort_request`` may be called from any thread (e.g. an asyncio event
loop) while another thread runs ``step()`` (``await asyncio.to_thread(core.step)``). They only touch an
inbox that ``step()`` drains first; an abort is applied at once (blocks freed) when no step is running,
else at the start of the next step. ``step()`` itself must be called from one thread at a time.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from flashpage.engine.detokenizer import IncrementalDetokenizer
from flashpage.engine.model_runner import ModelRunner, RunnerConfig
from flashpage.engine.outputs import Logprob, RequestMetrics, RequestOutput
from flashpage.engine.sampler import Sampler, SampleRow, build_logprob_dict, logprobs_with_ranks
from flashpage.engine.sampling_params import SamplingParams
from flashpage.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from flashpage.engine.sequence import Request, Sequence, SequenceStatus
from flashpage.engine.structured import StructuredOutputs
from flashpage.kv.block_manager import BlockManager

__all__ = ["EngineConfig", "EngineCore", "resolve_device", "resolve_dtype", "validate_messages"]

# Prompt positions whose logits are materialised at once for prompt logprobs (bounds the
# (rows, vocab) float32 temporary).
_PROMPT_LOGITS_ROWS = 256

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None`` -> ``cuda`` when available, else ``cpu``."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device: {device!r} is not a torch device ({e})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {device!r} requested but CUDA is not available")
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"device: only cpu and cuda are supported, got {device!r}")
    return dev


def _placement(config: EngineConfig, loaded: Any) -> tuple[torch.device, torch.dtype]:
    """The engine's device and dtype: the config's, or for an already loaded model where the config
    leaves them open (``device=None``, ``dtype="auto"``) the model's own; a config that names another
    device or dtype than the loaded model's is an error (the engine does not move weights)."""
    params = loaded.model.parameters() if loaded is not None else iter(())
    param = next((t for t in params if t.is_floating_point()), None)
    if param is None:
        device = resolve_device(config.device)
        return device, resolve_dtype(config.dtype, device)
    device = resolve_device(param.device if config.device is None else config.device)
    if (device.type, device.index or 0) != (param.device.type, param.device.index or 0):
        raise ValueError(f"device: the loaded model is on {param.device}, the config asks for {device}")
    auto = isinstance(config.dtype, str) and config.dtype.strip().lower() == "auto"
    dtype = param.dtype if auto else resolve_dtype(config.dtype, device)
    if dtype != param.dtype:
        raise ValueError(f"dtype: the loaded model holds {param.dtype}, the config asks for {dtype}")
    return device, dtype


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``"auto"`` -> bfloat16 on GPU, float32 on CPU; names like ``"bf16"`` or a torch dtype."""
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype: must be float32, bfloat16 or float16, got {dtype}")
        return dtype
    if not isinstance(dtype, str):
        raise ValueError(f"dtype: must be a string or torch.dtype, got {dtype!r}")
    key = dtype.strip().lower()
    if key == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if key not in _DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[key]


def _check_int(name: str, value: Any, lo: int = 1, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{name} must be an int >= {lo}{' or None' if allow_none else ''}, got {value!r}")


@dataclass
class EngineConfig:
    """Every option of the engine (validated on construction).

    Attributes:
        model: built-in name, HF directory or ``.gguf`` file (see ``flashpage.models.loader``).
        dtype: ``"auto"`` (an already loaded model's dtype, else bf16 on GPU, fp32 on CPU), a dtype
            name or a torch dtype.
        block_size: tokens per KV block (power of two, 8..256).
        max_num_seqs: most sequences running at once.
        max_num_batched_tokens: token budget per step (``None``: 8192 on GPU, 2048 on CPU).
        enable_prefix_caching: share KV blocks of identical prompt prefixes.
        gpu_memory_utilization: fraction of GPU memory for weights + activations + KV cache.
        kv_cache_bytes: KV cache size in bytes (overrides ``gpu_memory_utilization``).
        seed: seed of the sampler's shared generator (rows without a per-request seed) and of dummy
            weights.
        device: ``None`` = an already loaded model's device, else cuda if available, else cpu.
        load_format: ``auto`` | ``safetensors`` | ``gguf`` | ``dummy``.
        enforce_eager: no CUDA graphs.
        max_model_len: longest sequence (prompt + output); default the model's context, capped to
            what the KV cache holds; an explicit value the KV cache cannot hold is an error.
        model_config: config for ``load_format="dummy"`` or an override (ModelConfig or HF dict).
        tensor_parallel_size: ranks the model's heads, MLP columns and vocabulary are split over (one GPU
            each; processes on CPU). Rank 0 (this process) schedules and samples; without ``torchrun``
            it spawns the other ranks. ``kv_cache_bytes`` is then per rank. See
            :mod:`flashpage.engine.tp_workers`.
    """

    model: Any = "smollm2-135m-instruct"
    dtype: str | torch.dtype = "auto"
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_bytes: int | None = None
    seed: int = 0
    device: str | torch.device | None = None
    load_format: str = "auto"
    enforce_eager: bool = False
    max_model_len: int | None = None
    model_config: Any = None
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        bs = self.block_size
        if isinstance(bs, bool) or not isinstance(bs, int) or not 8 <= bs <= 256 or bs & (bs - 1):
            raise ValueError(f"block_size must be a power of two from 8 to 256, got {bs!r}")
        _check_int("max_num_seqs", self.max_num_seqs)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, allow_none=True)
        _check_int("kv_cache_bytes", self.kv_cache_bytes, allow_none=True)
        _check_int("max_model_len", self.max_model_len, lo=2, allow_none=True)
        _check_int("seed", self.seed, lo=0)
        _check_int("tensor_parallel_size", self.tensor_parallel_size)
        if self.tensor_parallel_size > 1 and not isinstance(self.model, str):
            raise ValueError(
                "tensor_parallel_size: needs the model as a name or path (every rank loads it), not a loaded object"
            )
        g = self.gpu_memory_utilization
        if isinstance(g, bool) or not isinstance(g, int | float) or not 0.0 < g <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {g!r}")
        for name in ("enable_prefix_caching", "enforce_eager"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.load_format not in ("auto", "safetensors", "gguf", "dummy"):
            raise ValueError(
                f"load_format must be one of auto, safetensors, gguf, dummy, got {self.load_format!r}"
            )


def runner_config(config: EngineConfig, device: torch.device) -> RunnerConfig:
    """The model runner's options of an engine config on ``device`` (every tensor-parallel rank uses it)."""
    return RunnerConfig(
        block_size=config.block_size,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=default_batched_tokens(config, device),
        max_model_len=config.max_model_len,
        kv_cache_bytes=config.kv_cache_bytes,
        gpu_memory_utilization=float(config.gpu_memory_utilization),
        enforce_eager=config.enforce_eager,
    )


def default_batched_tokens(config: EngineConfig, device: torch.device) -> int:
    """``max_num_batched_tokens``, or its default: 8192 on GPU, 2048 on CPU."""
    return config.max_num_batched_tokens or (8192 if device.type == "cuda" else 2048)


def validate_messages(messages: Any) -> list[dict[str, str]]:
    """Check an OpenAI-style conversation and normalise it to ``[{"role", "content"[, "name"]}]``.

    ``content`` is a string, or a list of ``{"type": "text", "text": ...}`` parts (joined with
    newlines, as vLLM does); ``None`` is accepted for an assistant message (read as ``""``).

    Raises:
        ValueError: ``"messages[i]: ..."`` for the first bad message.
    """
    if not isinstance(messages, list | tuple) or not messages:
        raise ValueError("messages: expected a non-empty list of {'role', 'content'} dicts")
    out: list[dict[str, str]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(
                f"messages[{i}]: expected a dict with 'role' and 'content', got {type(m).__name__}"
            )
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}]: 'role' must be a non-empty string, got {role!r}")
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""
        if isinstance(content, list | tuple):
            texts = []
            for j, part in enumerate(content):
                if not (
                    isinstance(part, dict)
                    and part.get("type") == "text"
                    and isinstance(part.get("text"), str)
                ):
                    raise ValueError(
                        f"messages[{i}]: content[{j}] must be a {{'type': 'text', 'text': str}} part, got {part!r}"
                    )
                texts.append(part["text"])
            content = "\n".join(texts)
        if not isinstance(content, str):
            raise ValueError(
                f"messages[{i}]: 'content' must be a string or a list of text parts, got {content!r}"
            )
        msg = {"role": role, "content": content}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def _percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    i = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[i]


class EngineCore:
    """Continuous-batching engine over one model (see the module docstring).

    Args:
        config: engine options.
        loaded: an already loaded model (an object with ``model``, ``config``, ``tokenizer`` and
            optionally ``chat_template`` / ``name``); ``config.model`` is loaded when ``None``.
    """

    def __init__(self, config: EngineConfig, loaded: Any = None) -> None:
        self.config = config
        self.tp: Any = None  # rank 0's TensorParallelDriver when tensor_parallel_size > 1
        if loaded is None and not isinstance(config.model, str):
            loaded = config.model  # an object from load_model()
        self.device, self.dtype = _placement(config, loaded)
        if config.tensor_parallel_size > 1:
            from flashpage.engine import tp_workers as tpar  # lazily: only tensor-parallel engines

            if tpar.torchrun_rank() not in (None, 0):
                # A torchrun rank other than 0 serves rank 0's steps, then exits with it.
                tpar.serve_launched_worker(config, self.device, self.dtype)
                raise SystemExit(0)
            if self.device.type == "cuda":
                self.device = tpar.rank_device(self.device, tpar.local_rank())
        if loaded is None:
            from flashpage.models.loader import load_model

            loaded = load_model(
                config.model,
                dtype=self.dtype,
                device=self.device,
                load_format=config.load_format,
                config=config.model_config,
                seed=config.seed,
            )
        self.loaded = loaded
        self.model = loaded.model
        self.model_config = loaded.config
        self.tokenizer = getattr(loaded, "tokenizer", None)
        self.chat_template = getattr(loaded, "chat_template", None)
        self.model_name = str(getattr(loaded, "name", None) or config.model)
        self.vocab_size = int(self.model_config.vocab_size)
        self.eos_token_ids = frozenset(
            int(t) for t in (getattr(self.model_config, "eos_token_ids", ()) or ())
        )
        if not self.eos_token_ids and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids = frozenset([int(self.tokenizer.eos_token_id)])
        mnbt = default_batched_tokens(config, self.device)
        self.sampler = Sampler(self.device, seed=config.seed)
        if config.tensor_parallel_size > 1:
            self.runner = self._start_tensor_parallel()
        else:
            self.runner = ModelRunner(
                self.model,
                self.model_config,
                device=self.device,
                dtype=self.dtype,
                config=runner_config(config, self.device),
                sampler_probe=self._probe_sampler,
            )
        self.max_model_len = self.runner.max_model_len
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=mnbt,
                max_model_len=self.max_model_len,
            ),
            self.block_manager,
        )
        self.max_num_batched_tokens = mnbt
        self.structured = StructuredOutputs(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self._token_text: dict[int, str] = {}
        self._requests: dict[str, Request] = {}
        self._live_ids: set[str] = set()
        self._inbox: deque[tuple[str, Any]] = deque()
        self._inbox_lock = threading.Lock()
        self._step_lock = threading.Lock()
        self._next_seq_id = 0
        self._arrivals = 0
        self._stats = _Counters()

    def _start_tensor_parallel(self) -> ModelRunner:
        """Start the other ranks, shard this rank's model, build its runner and hook the step broadcast."""
        from flashpage.engine.tp_workers import start_tensor_parallel

        self.tp = start_tensor_parallel(self.config, self.model_config, self.device, self.dtype)
        try:
            runner = self.tp.build_runner(
                self.config, self.model, self.model_config, self.dtype, sampler_probe=self._probe_sampler
            )
        except BaseException:
            self.tp.abort()
            raise
        runner.step_hook = self.tp.send_step
        return runner

    # ------------------------------------------------------------------ requests

    def _probe_sampler(self, logits: torch.Tensor) -> None:
        """Run the sampler's heaviest path once (memory profiling): logprobs, logit bias, a grammar
        bitmask on every row, penalties, temperature, top-k/p, min-p."""
        p = SamplingParams(
            temperature=0.8,
            top_p=0.9,
            top_k=50,
            min_p=0.05,
            presence_penalty=0.1,
            logprobs=5,
            logit_bias={0: 1.0},
        )
        rows = [SampleRow(p, [0], [0]) for _ in range(logits.shape[0])]
        words = -(-logits.shape[1] // 32)
        bitmask = torch.full((logits.shape[0], words), -1, dtype=torch.int32, device=logits.device)
        self.sampler.sample(logits, rows, bitmask)

    def encode(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        """Tokenize ``prompt`` with the model's tokenizer."""
        if self.tokenizer is None:
            raise ValueError("prompt: this model has no tokenizer; pass token ids instead of text")
        return list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        continue_final_message: bool = False,
    ) -> tuple[str, list[int]]:
        """Render one conversation through the chat template (vLLM semantics).

        Args:
            messages: ``[{"role", "content"}]`` (see :func:`validate_messages`).
            add_generation_prompt: open an assistant turn after the messages.
            chat_template: a Jinja template to use instead of the model's.
            continue_final_message: leave the last message open so the model continues it (for a
                prefilled assistant reply); exclusive with ``add_generation_prompt``.
        Returns:
            ``(prompt text, token ids)``; the special tokens come from the template only (the
            tokenizer adds none, so BOS is never doubled).
        Raises:
            ValueError: bad messages (``"messages[i]: ..."``), both flags set, no tokenizer or template,
                or a template that fails to render (``"chat_template: ..."``).
        """
        msgs = validate_messages(messages)
        if continue_final_message and add_generation_prompt:
            raise ValueError(
                "continue_final_message: cannot be combined with add_generation_prompt=True (pass "
                "add_generation_prompt=False to continue the final message)"
            )
        tok = self.tokenizer
        if tok is None:
            raise ValueError("messages: this model has no tokenizer, so chat is unavailable")
        if chat_template is not None and not isinstance(chat_template, str):
            raise ValueError(f"chat_template must be a string or None, got {type(chat_template).__name__}")
        template = chat_template or (None if getattr(tok, "chat_template", None) else self.chat_template)
        if template is None and not getattr(tok, "chat_template", None):
            raise ValueError("chat_template: this model has no chat template; pass one")
        try:
            text = tok.apply_chat_template(
                msgs,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template=template,
            )
        except Exception as e:  # jinja2 syntax/runtime errors, or the template rejecting the roles
            raise ValueError(f"chat_template: cannot render the messages ({type(e).__name__}: {e})") from None
        text = str(text)
        return text, self.encode(text, add_special_tokens=False)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | None = None,
        params: SamplingParams | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        arrival_time: float | None = None,
        stream: bool = True,
    ) -> None:
        """Queue a request.

        Args:
            request_id: unique among unfinished requests.
            prompt: text (tokenized here) or token ids.
            params: sampling parameters (default ``SamplingParams()``).
            prompt_token_ids: token ids (with ``prompt`` text too: used as-is, text kept for output).
            arrival_time: ``time.perf_counter()`` of arrival (default: now).
            stream: report every step with new tokens; else only the final output.
        Raises:
            ValueError: duplicate id, empty/too long prompt, token ids out of the vocabulary, prompt +
                ``max_tokens`` over ``max_model_len`` (``"max_tokens: ..."``), ``logit_bias`` ids out
                of the vocabulary, a structured-output constraint that does not compile (naming the
                ``guided_*`` field), bad params.
        """
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"n: {params.n} completions exceed max_num_seqs={self.config.max_num_seqs}")
        text: str | None = None
        if prompt_token_ids is not None:
            ids = list(prompt_token_ids)
            text = prompt if isinstance(prompt, str) else None
        elif isinstance(prompt, str):
            text = prompt
            ids = self.encode(prompt)
        elif isinstance(prompt, list | tuple):
            ids = list(prompt)
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt: must contain at least one token")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size for t in ids):
            raise ValueError(f"prompt: token ids must be ints in [0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt: {len(ids)} tokens leave no room for output within max_model_len={self.max_model_len}"
            )
        if params.max_tokens is not None and len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens: the prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len={self.max_model_len}; lower max_tokens to at most {self.max_model_len - len(ids)}"
            )
        bad = sorted(t for t in params.logit_bias_map if t >= self.vocab_size)
        if bad:
            raise ValueError(
                f"logit_bias: token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})"
            )
        if self.tp is not None and params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs: not supported with tensor_parallel_size > 1")
        grammar = self.structured.compile(params.guided) if params.guided is not None else None
        now = time.perf_counter()
        with self._inbox_lock:
            if request_id in self._live_ids:
                raise ValueError(f"request_id: {request_id!r} is already in use by an unfinished request")
            self._live_ids.add(request_id)
            self._arrivals += 1
            req = Request(
                request_id=request_id,
                prompt=text,
                prompt_token_ids=ids,
                params=params,
                arrival_order=self._arrivals,
                metrics=RequestMetrics(
                    arrival_time=arrival_time if arrival_time is not None else now, num_prompt_tokens=len(ids)
                ),
                stream=stream,
                tokenizer=self.tokenizer,
                grammar=grammar,
                prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
            )
            self._inbox.append(("add", req))

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Abort requests by id (unknown ids are ignored); their KV blocks are freed at once when no
        step is running, else at the start of the next step. No output is reported for them."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        with self._inbox_lock:
            for rid in ids:
                if rid in self._live_ids:
                    self._inbox.append(("abort", rid))
        if self._step_lock.acquire(blocking=False):
            try:
                self._drain_inbox()
            finally:
                self._step_lock.release()

    def has_unfinished(self) -> bool:
        """Whether any request is queued, running or not yet picked up."""
        with self._inbox_lock:
            return bool(self._live_ids)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        with self._inbox_lock:
            pending = sum(1 for kind, _ in self._inbox if kind == "add")
        return len(self.scheduler.waiting) + pending

    def _new_seq(self, req: Request, index: int) -> Sequence:
        self._next_seq_id += 1
        seq = Sequence(
            seq_id=self._next_seq_id,
            request=req,
            index=index,
            token_ids=list(req.prompt_token_ids),
            num_prompt_tokens=len(req.prompt_token_ids),
        )
        p = req.params
        if p.seed is not None:
            seed = p.seed if index == 0 else (p.seed * 1_000_003 + index) & (2**63 - 1)
            seq.generator = self.sampler.make_generator(seed)
        if p.logprobs is not None:
            seq.logprobs = []
            seq.cumulative_logprob = 0.0
        if req.grammar is not None:
            seq.matcher = self.structured.new_matcher(req.grammar)
        if self.tokenizer is not None:
            seq.detok = IncrementalDetokenizer(
                self.tokenizer,
                req.prompt_token_ids,
                skip_special_tokens=p.skip_special_tokens,
                stop=p.stop_strings,
                include_stop_str_in_output=p.include_stop_str_in_output,
            )
        req.seqs.append(seq)
        return seq

    def _drain_inbox(self) -> None:
        """Apply queued adds and aborts (caller holds the step lock)."""
        while True:
            with self._inbox_lock:
                if not self._inbox:
                    return
                kind, item = self._inbox.popleft()
            if kind == "add":
                req: Request = item
                self._requests[req.request_id] = req
                seq = self._new_seq(req, 0)
                seq.pending_forks = req.params.n - 1
                self.scheduler.add(seq)
                self._stats.prompt_tokens += len(req.prompt_token_ids)
            else:
                req = self._requests.pop(item, None)
                if req is not None:
                    self.scheduler.abort(req.seqs)
                    with self._inbox_lock:
                        self._live_ids.discard(item)
                    self._stats.aborted += 1

    # ------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, sample, and report.

        Returns:
            A :class:`RequestOutput` per request that finished this step, and per streaming request
            with new tokens (snapshots with ``delta_text`` / ``delta_token_ids``).
        """
        with self._step_lock:
            self._drain_inbox()
            t0 = time.perf_counter()
            sched = self.scheduler.schedule()
            if sched.is_empty:
                return []
            t1 = time.perf_counter()
            keep = [i for i, item in enumerate(sched.scheduled) if item.seq.needs_prompt_logits]
            with torch.inference_mode():
                logits = self.runner.execute(sched.scheduled, sched.copies, keep_hidden=keep)
                if keep:
                    self._collect_prompt_logprobs(sched, keep)
                t2 = time.perf_counter()
                self.scheduler.on_computed(sched)
                outputs = self._sample_and_update(sched, logits, t0)
            st = self._stats
            st.schedule_s += t1 - t0
            st.launch_s += t2 - t1
            self._account(sched, t0)
            return outputs

    def _decorate(self, d: dict[int, Logprob]) -> dict[int, Logprob]:
        """Fill in each entry's ``decoded_token`` (the token's own text)."""
        if self.tokenizer is not None:
            cache = self._token_text
            for t, lp in d.items():
                text = cache.get(t)
                if text is None:
                    text = cache[t] = str(self.tokenizer.decode([t]))
                lp.decoded_token = text
        return d

    def _collect_prompt_logprobs(self, sched: SchedulerOutput, keep: list[int]) -> None:
        """Prompt logprobs of the tokens predicted by the kept chunks' hidden states (row ``j`` of a
        chunk starting at ``start`` predicts prompt token ``start + j + 1``)."""
        for i in keep:
            item = sched.scheduled[i]
            seq = item.seq
            lps = seq.request.prompt_logprobs
            assert lps is not None
            hidden = self.runner.last_hidden[i]
            k = seq.params.prompt_logprobs or 0
            lo = max(item.start, len(lps) - 1)
            hi = min(item.start + item.num_tokens, seq.num_prompt_tokens - 1)
            if lo != len(lps) - 1:  # positions before this chunk were never collected
                continue
            for a in range(lo, hi, _PROMPT_LOGITS_ROWS):
                b = min(hi, a + _PROMPT_LOGITS_ROWS)
                logp = (
                    self.model.compute_logits(hidden[a - item.start : b - item.start]).float().log_softmax(-1)
                )
                targets = torch.tensor(seq.token_ids[a + 1 : b + 1], device=logp.device)
                chosen, ranks, top_v, top_i = logprobs_with_ranks(logp, targets, k)
                for j in range(b - a):
                    d = build_logprob_dict(seq.token_ids[a + 1 + j], chosen[j], ranks[j], top_v[j], top_i[j])
                    lps.append(self._decorate(d))
        self.runner.last_hidden = {}

    def _banned(self, seq: Sequence) -> tuple[int, ...]:
        """EOS and stop token ids while the completion is below ``min_tokens`` (not for constrained
        completions: their grammar decides when EOS may come)."""
        p = seq.params
        if p.min_tokens == 0 or seq.num_output_tokens >= p.min_tokens or seq.matcher is not None:
            return ()
        stops = p.stop_token_set if p.ignore_eos else p.stop_token_set | self.eos_token_ids
        return tuple(stops)

    def _sample_and_update(
        self, sched: SchedulerOutput, logits: torch.Tensor, t0: float
    ) -> list[RequestOutput]:
        seqs: list[Sequence] = []
        row_of: list[int] = []
        forked = False
        row = 0
        for item in sched.scheduled:
            seq = item.seq
            req = seq.request
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = t0
            if not item.samples:
                continue
            seqs.append(seq)
            row_of.append(row)
            if seq.pending_forks:
                # Prompt prefill done: the other completions start here, sharing every prompt block.
                for _ in range(seq.pending_forks):
                    child = self._new_seq(req, len(req.seqs))
                    self.scheduler.fork(seq, child)
                    seqs.append(child)
                    row_of.append(row)
                seq.pending_forks = 0
                forked = True
            row += 1
        if forked:
            logits = logits.index_select(0, torch.tensor(row_of, device=logits.device))
        rows = [
            SampleRow(
                s.params, s.token_ids[: s.num_prompt_tokens], s.output_token_ids, s.generator, self._banned(s)
            )
            if s.params.has_penalties
            else SampleRow(s.params, (), (), s.generator, self._banned(s))
            for s in seqs
        ]
        bitmask = None
        if any(s.matcher is not None for s in seqs):
            bitmask = self.structured.fill_bitmask([s.matcher for s in seqs], logits.device)
        result = self.sampler.sample(logits, rows, bitmask)
        now = time.perf_counter()
        touched: dict[str, Request] = {}
        for i, (seq, tok) in enumerate(zip(seqs, result.token_ids)):
            self._append_token(seq, tok, result.logprobs[i] if result.logprobs is not None else None, now)
            touched[seq.request.request_id] = seq.request
        outputs: list[RequestOutput] = []
        for rid, req in touched.items():
            if req.finished:
                req.metrics.finished_time = now
                outputs.append(req.make_output(final=True))
                self._requests.pop(rid, None)
                with self._inbox_lock:
                    self._live_ids.discard(rid)
                self._stats.record_finished(req)
            elif req.stream:
                outputs.append(req.make_output(final=False))
        return outputs

    def _append_token(self, seq: Sequence, tok: int, logprobs: dict[int, Logprob] | None, now: float) -> None:
        p = seq.params
        seq.token_ids.append(tok)
        m = seq.request.metrics
        m.num_generation_tokens += 1
        if m.first_token_time is None:
            m.first_token_time = now
        m.last_token_time = now
        if seq.index == 0:
            m.token_times.append(now)
        if seq.logprobs is not None and logprobs is not None:
            seq.logprobs.append(self._decorate(logprobs))
            seq.cumulative_logprob = (seq.cumulative_logprob or 0.0) + float(logprobs[tok])
        self._stats.generation_tokens += 1
        # Below min_tokens nothing ends the completion (a constrained one: only its grammar).
        may_stop = seq.num_output_tokens > p.min_tokens
        stop_str = seq.detok.add_tokens([tok], check_stop=may_stop) if seq.detok is not None else None
        status: SequenceStatus | None = None
        if seq.matcher is not None:
            may_stop = True
            # The grammar ends once it accepted a stop token (EOS only comes when it is complete); a
            # token it rejects (the mask does not allow one) ends the completion too.
            if not seq.matcher.accept_token(tok) or seq.matcher.is_terminated():
                status = SequenceStatus.FINISHED_STOPPED
        if status is not None or not may_stop:
            pass
        elif not p.ignore_eos and tok in self.eos_token_ids:
            status = SequenceStatus.FINISHED_STOPPED
        elif tok in p.stop_token_set:
            status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, tok
        elif stop_str is not None:
            status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, stop_str
        if status is None and (
            (p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens)
            or seq.num_tokens >= self.max_model_len
        ):
            status = SequenceStatus.FINISHED_LENGTH
        if status is not None:
            seq.finish_reason = "stop" if status == SequenceStatus.FINISHED_STOPPED else "length"
            self.scheduler.finish(seq, status)

    # ------------------------------------------------------------------ statistics

    def _account(self, sched: SchedulerOutput, t0: float) -> None:
        s = self._stats
        dt = time.perf_counter() - t0
        s.steps += 1
        s.busy_s += dt
        s.prompt_tokens_computed += sched.num_prefill_tokens
        if sched.num_prefill_tokens:
            s.prefill_busy_s += dt
        u = self.block_manager.usage()
        if u.used_blocks > s.peak_used_blocks:
            s.peak_used_blocks = u.used_blocks
            s.waste_at_peak = u.waste_frac
        if u.used_blocks:
            s.max_waste = max(s.max_waste, u.waste_frac)
            s.waste_weighted += u.waste_frac * u.used_blocks
            s.waste_weight += u.used_blocks

    def stats(self) -> dict[str, Any]:
        """Engine statistics since start-up.

        Keys: ``kv_blocks_total``, ``kv_blocks_used``, ``kv_blocks_cached_free``, ``kv_block_size``,
        ``kv_cache_bytes``, ``kv_waste_pct`` (now), ``kv_peak_blocks_used``, ``kv_waste_pct_at_peak``,
        ``kv_waste_pct_mean`` (block-weighted over steps), ``kv_waste_pct_max``,
        ``prefix_cache_hit_rate``, ``prompt_tokens``, ``prompt_tokens_computed``,
        ``generation_tokens``, ``prompt_tokens_per_s`` (computed prompt tokens / time of steps with
        prefill work), ``generation_tokens_per_s`` (generated tokens / busy time), ``busy_s`` (time
        in steps; of it ``schedule_s`` in the scheduler and ``launch_s`` building inputs and launching
        the forward; the rest samples, waits for the device and updates sequences),
        ``steps``, ``ttft_ms_mean``/``_p50``/``_p99``, ``num_preemptions``, ``num_running``,
        ``num_waiting``, ``max_model_len``, ``cuda_graphs``, ``roofline`` (per phase: op, kernel,
        num_splits, intensity, ridge, bound, steps, tokens).
        """
        s = self._stats
        u = self.block_manager.usage()
        ttft = [x * 1e3 for x in s.ttfts]
        return {
            "model": self.model_name,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "kv_blocks_total": u.num_blocks,
            "kv_blocks_used": u.used_blocks,
            "kv_blocks_cached_free": u.cached_free_blocks,
            "kv_block_size": self.block_manager.block_size,
            "kv_cache_bytes": self.runner.spec.total_bytes,
            "kv_waste_pct": 100.0 * u.waste_frac,
            "kv_peak_blocks_used": s.peak_used_blocks,
            "kv_waste_pct_at_peak": 100.0 * s.waste_at_peak,
            "kv_waste_pct_mean": 100.0 * s.waste_weighted / s.waste_weight if s.waste_weight else 0.0,
            "kv_waste_pct_max": 100.0 * s.max_waste,
            "prefix_cache_hit_rate": self.block_manager.prefix_cache_hit_rate,
            "prompt_tokens": s.prompt_tokens,
            "prompt_tokens_computed": s.prompt_tokens_computed,
            "generation_tokens": s.generation_tokens,
            "prompt_tokens_per_s": s.prompt_tokens_computed / s.prefill_busy_s if s.prefill_busy_s else 0.0,
            "generation_tokens_per_s": s.generation_tokens / s.busy_s if s.busy_s else 0.0,
            "busy_s": s.busy_s,
            "schedule_s": s.schedule_s,
            "launch_s": s.launch_s,
            "steps": s.steps,
            "requests_finished": s.finished,
            "requests_aborted": s.aborted,
            "ttft_ms_mean": sum(ttft) / len(ttft) if ttft else None,
            "ttft_ms_p50": _percentile(ttft, 50),
            "ttft_ms_p99": _percentile(ttft, 99),
            "num_preemptions": self.scheduler.num_preemptions,
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "max_model_len": self.max_model_len,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "cuda_graphs": {
                "enabled": bool(self.runner._graphs),
                "num_graphs": len(self.runner._graphs),
                "capture_s": self.runner.graph_capture_s,
            },
            "roofline": {ph: d.as_dict() for ph, d in self.runner.decisions.items()},
            "hardware_profile": getattr(self.runner.profile, "name", None),
        }

    def reset_stats(self) -> None:
        """Zero the throughput/latency counters (not the cache or its hit rate)."""
        self._stats = _Counters()
        for d in self.runner.decisions.values():
            d.steps = d.tokens = d.graph_steps = 0

    def close(self) -> None:
        """Abort everything and release device memory (graphs, KV cache)."""
        with self._inbox_lock:
            ids = list(self._live_ids)
        self.abort_request(ids)
        self.runner.close()
        if self.tp is not None:
            self.tp.close()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


@dataclass
class _Counters:
    steps: int = 0
    busy_s: float = 0.0
    schedule_s: float = 0.0
    launch_s: float = 0.0
    prefill_busy_s: float = 0.0
    prompt_tokens: int = 0
    prompt_tokens_computed: int = 0
    generation_tokens: int = 0
    finished: int = 0
    aborted: int = 0
    peak_used_blocks: int = 0
    waste_at_peak: float = 0.0
    max_waste: float = 0.0
    waste_weighted: float = 0.0
    waste_weight: float = 0.0
    ttfts: deque[float] | None = None

    def __post_init__(self) -> None:
        self.ttfts = deque(maxlen=100_000)

    def record_finished(self, req: Request) -> None:
        self.finished += 1
        t = req.metrics.ttft
        if t is not None:
            assert self.ttfts is not None
            self.ttfts.append(t)
