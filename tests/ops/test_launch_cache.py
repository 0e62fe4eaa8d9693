"""LaunchCache (flashpage.ops.launch_cache): replayed launches compute what ``kernel[grid]`` computes.

Under the interpreter Triton has no compiled kernel, so the replay path is driven here through a
stand-in: ``kernel[grid](...)`` runs the interpreted kernel and returns a fake compiled kernel
whose ``[grid](*every_parameter)`` (the form the cache replays with) maps the flat parameter list
back to the kernel's arguments and runs it again. On a GPU the same tests use the real compiled
kernels.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import triton
import triton.language as tl
from torch import Tensor

from flashpage.ops import flash_bwd as fb
from flashpage.ops import flash_fwd as ff
from flashpage.ops import paged_launch as pl
from flashpage.ops.flash_configs import BwdConfig
from flashpage.ops.kvcache import flash_attn_with_kvcache
from flashpage.ops.launch_cache import LaunchCache, aligned, int_spec, int_specs, kernel_launches
from flashpage.ops.paged_kernel import combine_kernel, paged_attn_kernel
from flashpage.ops.paged_plan import DecodePlan, plan_decode, run_decode
from flashpage.ops.reference import attention_ref, varlen_attention_ref
from flashpage.ops.utils import cdiv, next_pow2, programs_per_sm
from tests.tolerance import assert_close_to_ref


@pytest.fixture(autouse=True)
def on_device(device: str) -> Iterator[None]:
    with torch.device(device):
        yield


class _FakeCompiled:
    packed_metadata = None

    def __init__(self, owner: _FakeJit, n_args: int, options: dict[str, Any]) -> None:
        self.owner, self.n_args, self.options = owner, n_args, options

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        assert len(grid) == 3, "CompiledKernel[grid] reads grid[0], grid[1] and grid[2]"

        def runner(*params: Any) -> None:
            self.owner.replays += 1
            names = list(self.owner.names[self.n_args :])
            kwargs = dict(zip(names, params[self.n_args :], strict=True))
            self.owner.real[grid](*params[: self.n_args], **kwargs, **self.options)

        return runner


class _FakeJit:
    """Wraps a jit kernel: launches normally and hands back a replayable stand-in."""

    def __init__(self, real: Any) -> None:
        self.real, self.fn = real, real.fn
        self.names = list(real.arg_names)
        self.launches = self.replays = 0
        self.grids: list[tuple[int, ...]] = []

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            self.launches += 1
            self.grids.append(tuple(grid))
            self.real[grid](*args, **kwargs)
            options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
            return _FakeCompiled(self, len(args), options)

        return run


def _fresh_caches(
    monkeypatch: pytest.MonkeyPatch, device: str, module: Any, kernels: dict[str, Any]
) -> dict[str, _FakeJit]:
    """Give each kernel (label -> kernel) an empty LaunchCache (``kernel_launches``); on CPU they
    launch through the stand-in, returned by label (on CUDA: the real kernels, ``{}``)."""
    fakes = {}
    for name, kernel in kernels.items():
        fn = kernel if device == "cuda" else _FakeJit(kernel)
        if device != "cuda":
            fakes[name] = fn
        monkeypatch.setattr(kernel, "_flashpage_launches", LaunchCache(fn), raising=False)
    return fakes


@pytest.fixture
def replay_cache(monkeypatch: pytest.MonkeyPatch, device: str) -> _FakeJit | None:
    """The forward's LaunchCache, emptied; on CPU driven through the stand-in (returned)."""
    return _fresh_caches(monkeypatch, device, ff, {"_FWD_LAUNCHES": ff._attn_fwd_kernel}).get("_FWD_LAUNCHES")


def test_int_spec_classes() -> None:
    assert int_spec(1) == 1
    assert int_spec(0) == int_spec(16) == int_spec(-32) == int_spec(2**31 - 16) == 2
    assert int_spec(17) == int_spec(-1) == 0
    assert int_spec(2**31) == 6 and int_spec(2**31 + 1) == 4  # i64, multiple of 16 or not
    assert int_spec(2**63 + 1) == 8  # u64
    assert len({int_spec(x) for x in (1, 16, 17, 2**31, 2**31 + 1, 2**63 + 1)}) == 6
    assert int_specs((1, 16, 17, 2**31)) == (1, 2, 0, 6) and int_specs(()) == ()


def test_host_int_helpers_match_triton() -> None:
    import triton

    for n in range(1, 300):
        assert next_pow2(n) == triton.next_power_of_2(n)
        for b in (1, 16, 64, 128):
            assert cdiv(n, b) == triton.cdiv(n, b)
    assert cdiv(0, 64) == 0


def test_aligned_bits() -> None:
    x = torch.empty(64)
    assert aligned(x, x[4:], x[1:]) == 0b011

    class Descriptor:  # a tensor descriptor counts by its base tensor
        def __init__(self, base: torch.Tensor) -> None:
            self.base = base

    assert aligned(Descriptor(x[1:]), Descriptor(x), x[1:]) == 0b010


def test_padded_calls_replay_and_match(replay_cache: _FakeJit | None) -> None:
    """Same metadata, new tensors each call (and a new seed): replays, results as the reference."""
    for i in range(3):
        q, k, v = (torch.randn(2, 37, 4, 32) for _ in range(3))
        out, lse = ff.flash_fwd(q, k, v, causal=True)
        ref, ref_lse = attention_ref(q, k, v, causal=True)[:2]
        assert_close_to_ref(out, ref, ref)
        torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=0)
        if replay_cache is not None:
            assert replay_cache.launches == 1 and replay_cache.replays == i
    assert len(kernel_launches(ff._attn_fwd_kernel)) == 1


def test_dropout_seed_replays_bit_identically(replay_cache: _FakeJit | None) -> None:
    """The seed is a slot: a replay with seed s draws the mask a fresh launch with seed s draws."""
    q, k, v = (torch.randn(1, 40, 2, 32) for _ in range(3))
    first = ff.flash_fwd(q, k, v, dropout_p=0.3, seed=1234)[0]
    other = ff.flash_fwd(q, k, v, dropout_p=0.3, seed=98)[0]  # replay (seed class unchanged)
    again = ff.flash_fwd(q, k, v, dropout_p=0.3, seed=1234)[0]  # replay
    assert not torch.equal(first, other)
    assert torch.equal(first, again)
    if replay_cache is not None:
        assert replay_cache.replays == 2


def test_varlen_replays_across_batches(replay_cache: _FakeJit | None) -> None:
    """Packed batches of new lengths reuse the plan (max_seqlen, LSE strides and grid are per call)."""
    for lens_q, lens_k in (([5, 17, 9], [5, 30, 9]), ([3, 21], [40, 21]), ([11, 2, 13, 6], [11, 2, 13, 6])):
        cq = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
        ck = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
        q, k, v = (
            torch.randn(int(cq[-1]), 4, 32),
            torch.randn(int(ck[-1]), 2, 32),
            torch.randn(int(ck[-1]), 2, 32),
        )
        kw: dict[str, Any] = {"causal": True, "window_size": (7, -1)}
        out, lse = ff.flash_fwd(
            q,
            k,
            v,
            cu_seqlens_q=cq,
            cu_seqlens_k=ck,
            max_seqlen_q=max(lens_q),
            max_seqlen_k=max(lens_k),
            **kw,
        )
        ref, ref_lse = varlen_attention_ref(q, k, v, cq, ck, **kw)
        assert_close_to_ref(out, ref, ref)
        fin = torch.isfinite(ref_lse)
        assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
        torch.testing.assert_close(lse[fin], ref_lse[fin], atol=2e-5, rtol=0)
    if replay_cache is not None:
        assert replay_cache.replays >= 1


def test_new_metadata_makes_a_new_plan(replay_cache: _FakeJit | None) -> None:
    """Strides, masks, alibi and head counts are part of the key; a view with other strides is
    launched (and computed) as itself, not as the cached plan's tensors."""
    base = torch.randn(2, 30, 8, 32)
    k, v = torch.randn(2, 30, 4, 32), torch.randn(2, 30, 4, 32)
    ff.flash_fwd(base[:, :, :4], k, v)
    q = base[:, :, 4:]  # same shape, other data (same strides)
    out = ff.flash_fwd(q, k, v)[0]
    ref = attention_ref(q, k, v)[0]
    assert_close_to_ref(out, ref, ref)
    slopes = torch.rand(4)
    out = ff.flash_fwd(q, k, v, alibi_slopes=slopes, softcap=2.0)[0]
    ref = attention_ref(q, k, v, alibi_slopes=slopes, softcap=2.0)[0]
    assert_close_to_ref(out, ref, ref)
    qc = q.contiguous()
    out = ff.flash_fwd(qc, k, v, window_size=(3, 2))[0]
    ref = attention_ref(qc, k, v, window_size=(3, 2))[0]
    assert_close_to_ref(out, ref, ref)
    if replay_cache is not None:
        assert len(kernel_launches(ff._attn_fwd_kernel)) == 3
        assert replay_cache.launches == 3 and replay_cache.replays == 1
    else:  # CUDA: the tail-split decision also compiles (and keeps) a tail variant per launch key
        assert len(kernel_launches(ff._attn_fwd_kernel)) >= 3


_BWD_CACHES = {
    "_PRE_LAUNCHES": fb._bwd_preprocess_kernel,
    "_DKDV_LAUNCHES": fb._bwd_dkdv_kernel,
    "_FUSED_LAUNCHES": fb._bwd_fused_kernel,
    "_DQ_LAUNCHES": fb._bwd_dq_kernel,
}


@pytest.mark.parametrize(
    "cfg",
    [
        BwdConfig(16, 16, 16, 16, 4, 1, 4, 1, "separate"),
        BwdConfig(16, 32, 16, 16, 4, 1, 4, 1, "fused", use_tma=True),
        BwdConfig(16, 16, 16, 16, 4, 1, 4, 1, "fused", split_dkdv=True),
        BwdConfig(16, 16, 16, 16, 4, 1, 4, 1, "atomic"),
    ],
    ids=["separate", "fused-tma", "fused-split", "atomic"],
)
def test_backward_replays_bit_identically(
    monkeypatch: pytest.MonkeyPatch, device: str, cfg: BwdConfig
) -> None:
    """Each backward kernel's replay (new tensors, same metadata) gives the fresh launch's gradients;
    a varlen batch of other lengths reuses the plans and still matches a fresh launch."""
    kw: dict[str, Any] = {"causal": True, "config": cfg, "dropout_p": 0.1, "seed": 5}

    def grads(q: Tensor, k: Tensor, v: Tensor, do: Tensor, **extra: Any) -> tuple[Tensor, ...]:
        out, lse = ff.flash_fwd(q, k, v, causal=True, dropout_p=0.1, seed=5, **extra)
        return fb.flash_bwd(do, q, k, v, out, lse, **kw, **extra)

    q, k, v = torch.randn(2, 35, 4, 32), torch.randn(2, 35, 2, 32), torch.randn(2, 35, 2, 32)
    do = torch.randn_like(q)
    fakes = _fresh_caches(monkeypatch, device, fb, _BWD_CACHES)
    first = grads(q, k, v, do)
    again = grads(*(t.clone() for t in (q, k, v, do)))
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a, b)
    for lens in ([5, 30], [17, 3, 9]):
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        n = int(cu[-1])
        qv, kv, vv, dov = (
            torch.randn(n, 4, 32),
            torch.randn(n, 2, 32),
            torch.randn(n, 2, 32),
            torch.randn(n, 4, 32),
        )
        vk = {"cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": max(lens), "max_seqlen_k": max(lens)}
        replayed = grads(qv, kv, vv, dov, **vk)
        saved = {name: kernel_launches(kernel) for name, kernel in _BWD_CACHES.items()}
        _fresh_caches(monkeypatch, device, fb, _BWD_CACHES)
        fresh = grads(qv, kv, vv, dov, **vk)
        for name, cache in saved.items():
            monkeypatch.setattr(_BWD_CACHES[name], "_flashpage_launches", cache)
        for a, b in zip(fresh, replayed, strict=True):
            assert torch.equal(a, b)
    if fakes:
        used = [name for name, f in fakes.items() if f.launches]
        assert all(fakes[name].replays >= 2 for name in used), {
            n: (f.launches, f.replays) for n, f in fakes.items()
        }
        assert "_PRE_LAUNCHES" in used and ("_DQ_LAUNCHES" in used) == (cfg.dq_mode == "separate")


def _fresh_launcher(
    monkeypatch: pytest.MonkeyPatch, device: str
) -> tuple[pl.PagedLauncher, dict[str, _FakeJit]]:
    """A new eager :class:`~flashpage.ops.paged_launch.PagedLauncher` in place of the shared one; on
    CPU its kernels launch through the stand-in (returned by attribute name; on CUDA ``{}``)."""
    launcher = pl.PagedLauncher()
    fakes = {}
    for attr, kernel in (("_main", paged_attn_kernel), ("_combine", combine_kernel)):
        fn = kernel if device == "cuda" else _FakeJit(kernel)
        if device != "cuda":
            fakes[attr] = fn
        setattr(launcher, attr, LaunchCache(fn))
    monkeypatch.setattr(paged_attn_kernel, "_flashpage_eager", launcher, raising=False)
    return launcher, fakes


@pytest.mark.parametrize(
    "q_len,splits", [(1, 3), (1, 1), (5, 2)], ids=["decode-split", "decode", "prefill-split"]
)
def test_paged_attention_replays_bit_identically(
    monkeypatch: pytest.MonkeyPatch, device: str, q_len: int, splits: int
) -> None:
    """Paged decode / chunked prefill (+ LSE, 2-D ALiBi with a non-contiguous batch stride): calls with
    new tensors and new cache lengths replay the plans (through ``flash_attn_with_kvcache``'s bound
    launches) and equal fresh launches."""
    b, h, hk, d, bs, nb = 3, 8, 2, 32, 16, 24
    k_cache, v_cache = torch.randn(nb, bs, hk, d), torch.randn(nb, bs, hk, d)
    table = torch.randperm(nb, dtype=torch.int32)[: b * 8].reshape(b, 8)
    slopes = torch.rand(b, 2 * h)[:, :h]  # batch stride 2h

    def run(q: Tensor, lens: list[int], alibi: Tensor | None) -> tuple[Tensor, Tensor]:
        out = flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=torch.tensor(lens, dtype=torch.int32), block_table=table,
            causal=True, num_splits=splits, return_softmax_lse=True, alibi_slopes=alibi,
        )  # fmt: skip
        return out  # type: ignore[return-value]

    def fresh() -> dict[str, _FakeJit]:
        return _fresh_launcher(monkeypatch, device)[1]

    fakes = fresh()
    calls = [([40, 77, 128], None), ([9, 100, 33], None), ([40, 77, 128], slopes), ([120, 5, 64], slopes)]
    run(torch.randn(b, q_len, h, d), *calls[0])  # makes the plans the calls below replay
    torch.manual_seed(1)
    qs = [torch.randn(b, q_len, h, d) for _ in calls]
    replayed = [run(q, lens, a) for q, (lens, a) in zip(qs, calls, strict=True)]
    for q, (lens, a), got in zip(qs, calls, replayed, strict=True):
        fresh()
        want = run(q, lens, a)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), lens
    if fakes:
        assert fakes["_main"].replays >= 3
        assert (fakes["_combine"].replays >= 3) == (splits > 1)
    other = slopes.contiguous()  # same values, batch stride h: must not replay the strided launch
    launcher, _ = _fresh_launcher(monkeypatch, device)
    run(qs[2], calls[2][0], slopes)
    torch.testing.assert_close(run(qs[2], calls[2][0], other)[0], replayed[2][0], rtol=0, atol=0)
    assert len(launcher) == 2


def test_run_decode_relaunches_the_compiled_kernels(monkeypatch: pytest.MonkeyPatch, device: str) -> None:
    """A decode plan's bound launches go through the compiled kernels' launchers (the stand-in on
    CPU) with each call's tensors, bit-identical to a fresh plan's first launch."""
    b, h, hk, d, bs, nb = 3, 8, 2, 32, 16, 24
    k_cache, v_cache = torch.randn(nb, bs, hk, d), torch.randn(nb, bs, hk, d)
    table = torch.randperm(nb, dtype=torch.int32)[: b * 8].reshape(b, 8)

    def plan() -> DecodePlan:
        return plan_decode(b, h, hk, d, block_size=bs, max_seqlen_k=128, q_dtype=torch.float32,
                           device=device, num_splits=3)  # fmt: skip

    _, fakes = _fresh_launcher(monkeypatch, device)
    p = plan()
    calls = [
        (torch.randn(b, h, d), torch.tensor(lens, dtype=torch.int32))
        for lens in ([40, 77, 128], [9, 100, 33])
    ]
    got = [run_decode(p, q, k_cache, v_cache, table, lens) for q, lens in calls + calls[::-1]]
    if fakes:
        for name in ("_main", "_combine"):
            assert fakes[name].launches == 1 and fakes[name].replays == 3, name
    for (q, lens), out in zip(calls + calls[::-1], got, strict=True):
        _fresh_launcher(monkeypatch, device)
        assert torch.equal(run_decode(plan(), q, k_cache, v_cache, table, lens), out)


def _vec_args(x: Tensor, y: Tensor) -> tuple[list[Any], dict[str, Any]]:
    return [x, y, x.numel()], {"BLOCK": 16}


def test_plan_rejects_a_tensor_outside_the_slots() -> None:
    """A tensor baked into a plan would be reused by later calls: refused when the plan is made."""
    fake = _FakeJit(ff._attn_fwd_kernel)
    cache = LaunchCache(fake)
    x, y = torch.zeros(16), torch.zeros(16)
    with pytest.raises(AssertionError, match="argument 1 is a tensor"):
        cache._template(*_vec_args(x, y), slots=(0,), values=(x,))
    with pytest.raises(AssertionError, match="slot 1"):
        cache._template(*_vec_args(x, y), slots=(0, 1), values=(x, x))


def test_tail_split_launches_replay(monkeypatch: pytest.MonkeyPatch, device: str) -> None:
    """The split forward (1-D grid) and its combine launch replay with new tensors each call."""
    fakes = _fresh_caches(
        monkeypatch,
        device,
        ff,
        {"_FWD_LAUNCHES": ff._attn_fwd_kernel, "_COMBINE_LAUNCHES": ff._fwd_tail_combine_kernel},
    )
    for i in range(3):
        q, k, v = torch.randn(2, 37, 3, 32), torch.randn(2, 100, 3, 32), torch.randn(2, 100, 3, 32)
        assert ff.plan_tail_split(3 * 2 * 3, 7, 5) is not None  # 16 x 16 tiles: the split runs
        out, lse = ff.flash_fwd(q, k, v, softcap=2.0, resident_programs=5)
        ref, ref_lse = attention_ref(q, k, v, softcap=2.0)[:2]
        assert_close_to_ref(out, ref, ref)
        torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=0)
        for name in ("_FWD_LAUNCHES", "_COMBINE_LAUNCHES") if fakes else ():
            assert fakes[name].launches == 1 and fakes[name].replays == i
    if fakes:
        assert len(fakes["_FWD_LAUNCHES"].grids[0]) == 1  # the split's 1-D grid
        assert fakes["_COMBINE_LAUNCHES"].grids[0][1] == 32 // 32  # one 32-column slice of d = 32


@triton.jit
def _add_one_kernel(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, tl.load(X + offs, mask=offs < n) + 1.0, mask=offs < n)


class _WarmJit(_FakeJit):
    """A stand-in that can also compile without launching (``JITFunction.warmup``)."""

    def __init__(self, real: Any) -> None:
        super().__init__(real)
        self.warmups = 0

    def warmup(self, *args: Any, grid: tuple[int, ...], **kwargs: Any) -> Any:
        self.warmups += 1
        options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
        return _FakeCompiled(self, len(args), options)


def test_compiled_makes_the_plan_launch_replays() -> None:
    x, y = torch.arange(20.0), torch.zeros(20)

    def build() -> tuple[list[Any], dict[str, Any]]:
        return [x, y, 20], {"BLOCK": 16}

    warm = _WarmJit(_add_one_kernel)
    cache = LaunchCache(warm)
    kernel = cache.compiled("k", (0, 1), (x, y), build)
    assert isinstance(kernel, _FakeCompiled) and warm.warmups == 1 and warm.launches == 0
    assert cache.compiled("k", (0, 1), (x, y), build) is kernel and warm.warmups == 1  # memo
    cache.launch("k", (2,), (0, 1), (x, y), build)
    assert warm.launches == 0 and warm.replays == 1
    torch.testing.assert_close(y, x + 1)
    # nothing to compile without warmup (the interpreter's kernels): None, no plan
    plain = LaunchCache(_FakeJit(_add_one_kernel))
    assert plain.compiled("k", (0, 1), (x, y), build) is None and len(plain) == 0


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "interpreted"])
def test_bound_launch_refills_only_its_open_slots(compiled: bool) -> None:
    """``launch(..., bind=positions)`` hands back the launch with those positions emptied (no
    per-call tensor kept alive); ``relaunch`` fills them and launches, through the compiled kernel
    where there is one (the stand-in here), else through ``kernel[grid]`` with the bound options."""
    kernel = _FakeJit(_add_one_kernel) if compiled else _add_one_kernel
    cache = LaunchCache(kernel)
    x, y = torch.arange(20.0), torch.zeros(20)

    def build() -> tuple[list[Any], dict[str, Any]]:
        return [x, y, 20], {"BLOCK": 16}

    first = cache.launch("k", (2,), (0, 1), (x, y), build, bind=(0, 1))  # compiles (or interprets)
    again = cache.launch("k", (2,), (0, 1), (x, y), build, bind=(0, 1))  # a plan's replay, if any
    assert cache.launch("k", (2,), (0, 1), (x, y), build) is None  # nothing bound unless asked
    torch.testing.assert_close(y, x + 1)
    for bound in (first, again):
        assert bound is not None and bound._args[:2] == [None, None] and bound._args[2] == 20
        x2, y2 = torch.randn(20), torch.zeros(20)
        bound.relaunch((x2, y2))
        torch.testing.assert_close(y2, x2 + 1)
        with pytest.raises(ValueError):  # every open position, no more
            bound.relaunch((x2,))
    if compiled:
        assert len(cache) == 1 and kernel.launches == 1 and kernel.replays == 4


def test_programs_per_sm_occupancy_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    props = SimpleNamespace(
        max_threads_per_multi_processor=2048,
        shared_memory_per_multiprocessor=233472,
        regs_per_multiprocessor=65536,
    )
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)

    def kernel(warps: int, smem: int, regs: int | None) -> Any:
        k = SimpleNamespace(metadata=SimpleNamespace(num_warps=warps, shared=smem))
        if regs is not None:
            k.n_regs = regs
        return k

    dev = torch.device("cuda", 0)
    assert programs_per_sm(kernel(8, 230400, 188), dev) == 1  # d=128 forward on the H200: shared memory
    assert programs_per_sm(kernel(4, 66560, 188), dev) == 2  # 192 x 32 registers per warp: 10 warps
    assert programs_per_sm(kernel(4, 0, 64), dev) == 8  # registers: 32 warps
    assert programs_per_sm(kernel(4, 0, None), dev) == 16  # threads only
    assert programs_per_sm(kernel(16, 200000, 255), dev) == 1  # never below one


def test_remembered_computes_once_per_key() -> None:
    cache = LaunchCache(_FakeJit(_add_one_kernel))
    calls: list[int] = []
    assert cache.remembered("a", lambda: calls.append(1) or 7) == 7
    assert cache.remembered("a", lambda: calls.append(2) or 8) == 7
    assert cache.remembered("b", lambda: 0) == 0 and calls == [1]
    cache.clear()
    assert cache.remembered("a", lambda: 9) == 9


def test_every_kernel_launch_pins_fp_fusion(monkeypatch: pytest.MonkeyPatch, device: str) -> None:
    """Each flashpage kernel is launched with ``KERNEL_OPTIONS`` (fp fusion on), directly or through a
    LaunchCache: triton 3.10 turns fusion off where a launch leaves it unset. Seen on the interpreter,
    which receives every launch's keyword arguments before it drops the compile options."""
    if device == "cuda":
        pytest.skip("records launches through the Triton interpreter")
    from triton.runtime.interpreter import InterpretedFunction

    from flashpage.ops.cache_write import reshape_and_cache
    from flashpage.ops.flash_attn import flash_attn_func
    from flashpage.ops.fused_ops import rms_norm, rope_qk, silu_and_mul
    from flashpage.ops.launch_cache import KERNEL_OPTIONS

    seen: dict[str, set[Any]] = {}
    real_run = InterpretedFunction.run

    def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        seen.setdefault(self.__name__, set()).add(kwargs.get("enable_fp_fusion"))
        return real_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", run)
    monkeypatch.setenv("FLASHPAGE_BACKEND", "triton")
    t, h, hk, d = 5, 4, 2, 32
    rms_norm(torch.randn(t, 32), torch.ones(32), 1e-6, residual=torch.randn(t, 32))
    rope_qk(torch.randn(t, h, d), torch.randn(t, hk, d), torch.randn(t, d // 2), torch.randn(t, d // 2))
    silu_and_mul(torch.randn(t, 64))
    k_cache, v_cache = torch.zeros(8, 16, hk, d), torch.zeros(8, 16, hk, d)
    reshape_and_cache(torch.randn(t, hk, d), torch.randn(t, hk, d), k_cache, v_cache, torch.arange(t))
    q, k, v = (torch.randn(1, 24, n, d, requires_grad=True) for n in (h, hk, hk))
    out, _, _ = flash_attn_func(q, k, v, dropout_p=0.1, causal=True, return_attn_probs=True)
    out.sum().backward()
    block_table = torch.arange(8, dtype=torch.int32).view(1, 8)
    flash_attn_with_kvcache(
        q[:, :1].detach(), k_cache, v_cache, cache_seqlens=128, block_table=block_table, num_splits=2
    )
    expected = {
        "_rms_norm_kernel", "_rope_kernel", "_silu_mul_kernel", "_reshape_and_cache_kernel", "_attn_fwd_kernel",
        "_attn_probs_kernel", "paged_attn_kernel", "combine_kernel",
    }  # fmt: skip
    assert expected <= seen.keys(), sorted(seen)
    assert any(name.startswith("_bwd") for name in seen), sorted(seen)
    unpinned = {name: flags for name, flags in seen.items() if flags != {KERNEL_OPTIONS["enable_fp_fusion"]}}
    assert not unpinned and KERNEL_OPTIONS["enable_fp_fusion"] is True, unpinned
