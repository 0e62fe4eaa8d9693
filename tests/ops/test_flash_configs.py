"""Tile tables and candidate lists of the FlashAttention kernels."""

from __future__ import annotations

import pytest
import torch

from flashpage.ops.flash_configs import (
    ANY_SEQLEN,
    HOPPER_BWD,
    HOPPER_FWD,
    BwdConfig,
    FwdConfig,
    bwd_candidates,
    fwd_candidates,
    table_lookup,
)
from flashpage.ops.utils import triton_version


@pytest.mark.parametrize("table", [HOPPER_FWD, HOPPER_BWD])
def test_tables_cover_every_head_dim_and_mask_for_any_length(table: dict) -> None:
    for d in (32, 64, 128, 256):
        for causal in (False, True):
            assert (d, causal, ANY_SEQLEN) in table
            for s in (1, 1024, 1025, 4096, 4097, 1 << 20, None):
                assert table_lookup(table, d, causal, s) is not None


def _score_rows(cfg: FwdConfig | BwdConfig) -> list[tuple[int, int]]:
    """(rows of a score tile, warps of its kernel) for every kernel the config launches."""
    if isinstance(cfg, FwdConfig):
        return [(cfg.block_m, cfg.num_warps)]
    return [(cfg.block_n1, cfg.num_warps), (cfg.block_m2, cfg.num_warps2)]


@pytest.mark.parametrize("d", [32, 64, 128, 256])
def test_hopper_configs_give_every_warp_its_own_score_rows(d: int) -> None:
    # A score tile of fewer than 16 rows per warp is computed once per warpgroup on Hopper (Triton
    # puts all warps along M for a dot that feeds a dot): d=256 ran at 0.80x SDPA-flash that way.
    dev = torch.device("cpu")
    cfgs = [c for (dd, _, _), c in (*HOPPER_FWD.items(), *HOPPER_BWD.items()) if dd == d]
    cfgs += fwd_candidates(d, dev) + bwd_candidates(d, dev)
    for cfg in cfgs:
        for rows, warps in _score_rows(cfg):
            assert rows >= 16 * warps, cfg


def test_table_lookup_picks_smallest_bucket_at_or_above_the_length() -> None:
    t = {(128, True, 1024): "a", (128, True, 4096): "b", (128, True, ANY_SEQLEN): "c"}
    assert [table_lookup(t, 128, True, s) for s in (1, 1024, 1025, 4096, 4097, None)] == list("aabbcc")
    assert table_lookup(t, 64, True, 100) is None


@pytest.mark.parametrize("d", [32, 64, 96, 128, 192, 256])
def test_candidates_are_valid_distinct_configs(d: int) -> None:
    dev = torch.device("cpu")
    for cands, typ in ((fwd_candidates(d, dev), FwdConfig), (bwd_candidates(d, dev), BwdConfig)):
        assert cands and all(isinstance(c, typ) for c in cands)
        assert len({c.short() for c in cands}) == len(cands)  # no config is timed twice


def test_pdl_needs_sm90_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Programmatic dependent launch (griddepcontrol) only on CUDA sm_90+, never the interpreter."""
    import flashpage.ops.utils as fc

    assert not fc.pdl_supported(torch.device("cpu"))
    for major, expected in ((8, False), (9, True), (10, True)):
        monkeypatch.setattr(fc, "cuda_capability", lambda device, major=major: (major, 0))
        assert fc.pdl_supported(torch.device("cuda", 0)) is expected


def test_ws_needs_sm90_cuda_and_gluon(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Gluon warp-specialized forward runs on CUDA sm_90 only (not sm_80, not Blackwell's
    tcgen05 parts, never the interpreter), and only with Gluon's Hopper ops in triton."""
    import flashpage.ops.utils as fc

    assert not fc.ws_supported(torch.device("cpu"))
    monkeypatch.setattr(fc, "interpreter_enabled", lambda: False)
    for major, expected in ((8, False), (9, True), (10, False)):
        monkeypatch.setattr(fc, "cuda_capability", lambda device, major=major: (major, 0))
        assert fc.ws_supported(torch.device("cuda", 0)) is expected
    monkeypatch.setattr(fc, "_triton_has", lambda module, *names: False)
    assert not fc.ws_supported(torch.device("cuda", 0))


def test_ws_stages_validated_and_labelled() -> None:
    assert FwdConfig(128, 128, 8, 3, True, ws_stages=3).short() == "m128n128w8s3tma-ws3"
    assert "ws" not in FwdConfig(128, 128, 8, 3, True).short()
    with pytest.raises(ValueError, match="ws_stages"):
        FwdConfig(ws_stages=4)
    # The Hopper table's Gluon entries keep a Triton config for what the Gluon kernel does not take.
    ws = [(key, c) for key, c in HOPPER_FWD.items() if c.ws_stages]
    assert ws and all(key[0] in (64, 128) for key, _ in ws)


@pytest.mark.parametrize(
    ("release", "expected"),
    [("3.6.0", (3, 6)), ("3.9.0+git1a2b3c", (3, 9)), ("3.10rc1", (3, 10)), ("4.0", (4, 0))],
)
def test_triton_version_parses_releases(
    monkeypatch: pytest.MonkeyPatch, release: str, expected: tuple
) -> None:
    import triton

    monkeypatch.setattr(triton, "__version__", release)
    assert triton_version.__wrapped__() == expected
