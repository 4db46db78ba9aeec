"""Kernel tests of dsa/triton/topk.py against a plain-torch form of the contract.

CPU: the Triton interpreter on tiny rows (both the resident and the streaming
kernel, the latter forced by a small ``resident_max``). GPU (``gpu`` marker):
the benchmark sizes, ties included.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import pytest  # noqa: E402

from dsa._args import TopkArgs  # noqa: E402
from dsa.triton import topk as tk  # noqa: E402

INF = float("inf")
NAN = float("nan")


def topk_contract(scores: torch.Tensor, k: int):
    """The top-k of docs/semantics.md in plain torch: the k largest scores (NaN, -inf never),
    ties to the smaller position, positions ascending, -1 padded."""
    x = scores.double()
    R, S = x.shape
    valid = ~torch.isnan(x) & (x != -INF)
    x = torch.where(valid, x, torch.full_like(x, -INF))
    order = torch.sort(x, dim=1, descending=True, stable=True).indices  # ties: smaller position first
    n_sel = valid.sum(dim=1).clamp(max=k)
    width = min(k, S)
    picked = order[:, :width]
    keep = torch.arange(width, device=x.device)[None, :] < n_sel[:, None]
    picked = torch.where(keep, picked, torch.full_like(picked, S))
    picked = torch.sort(picked, dim=1).values
    out = torch.full((R, k), -1, dtype=torch.int64, device=x.device)
    out[:, :width] = torch.where(picked == S, torch.full_like(picked, -1), picked)
    return out.to(torch.int32), n_sel.to(torch.int32)


def _run(scores: torch.Tensor, k: int, **launch_kw):
    if not launch_kw:
        return tk.topk(TopkArgs(scores, k))
    R = scores.shape[0]
    idx = torch.full((R, k), 12345, dtype=torch.int32, device=scores.device)  # poisoned
    lens = torch.full((R,), 12345, dtype=torch.int32, device=scores.device)
    tk.launch(scores, k, idx, lens, **launch_kw)
    return idx, lens


def _special_rows(R: int, S: int, gen: torch.Generator) -> torch.Tensor:
    """Integer-valued scores (many ties) with NaN, +-inf, -0.0 and degenerate rows."""
    x = torch.randint(-4, 5, (R, S), generator=gen).float()
    x[x == 4] = INF
    x[x == -4] = -INF
    x[0, :] = -INF  # nothing selectable
    x[1, :] = NAN
    x[2, ::3] = NAN
    x[3, :] = 1.0  # all tied
    x[4, 1::2] = -0.0
    x[4, ::2] = 0.0
    x[5, : S // 2] = -INF
    return x


KERNEL_PATHS = [
    pytest.param({}, id="resident"),
    pytest.param({"config": tk.ResidentConfig(num_warps=8)}, id="resident-8warps"),
    pytest.param({"resident_max": 8, "chunk": 16}, id="stream"),
]


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("S,k", [(1, 1), (1, 3), (7, 3), (37, 5), (37, 37), (37, 50), (100, 17), (64, 64)])
def test_ties_nan_inf(path, S, k):
    gen = torch.Generator().manual_seed(S * 131 + k)
    x = _special_rows(8, S, gen) if S >= 7 else torch.randint(-2, 3, (3, S), generator=gen).float()
    idx, lens = _run(x, k, **path)
    ref_idx, ref_len = topk_contract(x, k)
    assert idx.dtype == torch.int32 and lens.dtype == torch.int32
    assert torch.equal(lens, ref_len)
    assert torch.equal(idx, ref_idx)


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_random_values(path, dtype):
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(5, 90, generator=gen) * 1e3).to(dtype)
    x[1, 10:20] = x[1, 0]  # a tie run
    idx, lens = _run(x, 11, **path)
    ref_idx, ref_len = topk_contract(x, 11)
    assert torch.equal(idx, ref_idx) and torch.equal(lens, ref_len)


# The list path on short rows (a plan forces it): a sample of 16 scores in two
# runs of 8; ``rank`` picks the bound (17: every selectable key), block and
# cap the select tiers. "select" sends every row through the select kernel,
# "tiers" most rows through the larger block, "fallback" most rows through
# the streaming select (bound too high, or lists over the capacity).
def _plan(S, rank, block, cap, chunk=32, **kw):
    return tk.ListPlan(sample=16, stride=S // 2, rank=rank, block=block, cap=cap, chunk=chunk, **kw)


LIST_PLANS = [
    pytest.param((17, 256, 256), id="select"),
    # with the select kernel for both tiers (no inline select), first row first
    pytest.param((6, 16, 256, 32, {"slack": 3, "inline_select": False, "reverse": False}), id="tiers-slack"),
    pytest.param((1, 16, 32), id="fallback"),
    pytest.param((4, 256, 256, 64, {"list_search": "bisect"}), id="select-bisect"),
    pytest.param((4, 256, 256, 64, {"list_search": "radix"}), id="select-radix"),
]


@pytest.mark.parametrize("plan", LIST_PLANS)
@pytest.mark.parametrize("S,k", [(100, 1), (200, 17), (200, 250)])
def test_list_path(plan, S, k):
    gen = torch.Generator().manual_seed(S * 7 + k)
    x = torch.cat([_special_rows(8, S, gen), torch.randn(3, S, generator=gen)])
    x[9, : S // 4] = -INF  # a causal-like row
    rank, block, cap, *rest = plan
    chunk, kw = rest if rest else (32, {})
    idx, lens = _run(x, k, plan=_plan(S, rank, block, cap, chunk, **kw))
    ref_idx, ref_len = topk_contract(x, k)
    assert torch.equal(lens, ref_len)
    assert torch.equal(idx, ref_idx)


def test_list_path_fp16_and_strided():
    gen = torch.Generator().manual_seed(5)
    base = torch.randint(-6, 7, (4, 150), generator=gen).half()
    base[0, ::9] = NAN
    view = base[:, :120]
    idx, lens = _run(view, 13, plan=_plan(120, 4, 32, 128, chunk=64))
    ref_idx, ref_len = topk_contract(view, 13)
    assert torch.equal(idx, ref_idx) and torch.equal(lens, ref_len)


def test_list_build_holds_the_keys_above_the_bound():
    """The build kernel's list: every score whose key is >= the sampled bound,
    in position order, and the counts (list length, selectable keys)."""
    gen = torch.Generator().manual_seed(9)
    S, cap = 96, 64
    x = torch.randn(5, S, generator=gen)
    x[1, ::4] = NAN
    x[2, 10:] = -INF
    x[3, 3:] = -INF  # fewer selectable sampled scores than the rank: the whole row
    x[4, 40:] = 1.5  # ties across the bound
    vals = torch.full((5, cap), 7, dtype=torch.int32)
    pos = torch.full((5, cap), -7, dtype=torch.int32)
    meta = torch.full((5, 2), -1, dtype=torch.int32)
    rank, stride = 5, S // 2
    unused = torch.zeros(5, dtype=torch.int32)  # no per-row ends, no select here
    tk._list_build_kernel[(5,)](x, vals, pos, meta, unused, unused, unused, 0, 5, S, 1, x.stride(0), 1, rank, 0,
                                stride, CAP=cap, CHUNK=32, SAMPLE=16, ASM_STORE=False)
    cols = torch.cat([torch.arange(8), torch.arange(stride, stride + 8)])
    for r in range(5):
        ok = ~torch.isnan(x[r]) & (x[r] != -INF)
        sample = x[r, cols][ok[cols]].sort(descending=True).values
        lo = sample[rank - 1] if sample.numel() > rank else -INF
        above = torch.nonzero(ok & (x[r] >= lo)).flatten()
        n = above.numel()
        assert meta[r].tolist() == [n, int(ok.sum())]
        m = min(n, cap)
        assert torch.equal(pos[r, :m], above[:m].int())
        assert torch.equal(vals[r, :m].view(torch.float32), x[r, above[:m]])
        assert (pos[r, m:] == -7).all()  # nothing past the list


def test_list_build_scaled_sample_follows_the_row_length():
    """With row ends and SCALED_SAMPLE, a row of at most S / 4 (S / 2) keys
    samples SAMPLE / 4 (SAMPLE / 2) scores spread over its length: its
    bound has rank to rank + slack of exactly those sampled keys at or
    above it (the rank set for that sample and length), and its list is
    every key >= the bound, in position order."""
    import math

    gen = torch.Generator().manual_seed(4)
    S, sample, k, cap = 1024, 128, 9, 512
    ends = torch.tensor([1024, 1000, 600, 512, 300, 200, 20], dtype=torch.int32)
    R = ends.numel()
    x = torch.randn(R, S, generator=gen)
    x[1, ::7] = NAN
    vals = torch.full((R, cap), 7, dtype=torch.int32)
    pos = torch.full((R, cap), -7, dtype=torch.int32)
    meta = torch.full((R, 2), -1, dtype=torch.int32)
    unused = torch.zeros(R, dtype=torch.int32)
    tk._list_build_kernel[(R,)](x, vals, pos, meta, ends, unused, unused, 0, R, S, k, x.stride(0), 1, 0, 0, 0,
                                CAP=cap, CHUNK=64, SAMPLE=sample, ASM_STORE=False, HAS_END=True, WHOLE_MAX=32,
                                SCALED_SAMPLE=True)
    for r in range(R):
        L = int(ends[r])
        row = x[r, :L]
        ok = ~torch.isnan(row)
        n_list = int(meta[r, 0])
        assert int(meta[r, 1]) == int(ok.sum()) and 0 < n_list <= cap
        listed = vals[r, :n_list].view(torch.float32)
        lo = listed.min()
        above = torch.nonzero(ok & (row >= lo)).flatten()
        assert torch.equal(pos[r, :n_list], above.int()) and torch.equal(listed, row[above])
        if L <= 32:  # taken whole
            assert n_list == int(ok.sum())
            continue
        n = sample // 4 if 4 * L <= S else sample // 2 if 2 * L <= S else sample
        stride = max(L // (n // 8) // 8, 1) * 8
        o = torch.arange(n)
        cols = (o // 8) * stride + o % 8
        got = row[cols[cols < L]]
        m = k * n / L
        rank = math.ceil(((5 + math.sqrt(25 + 4 * m)) / 2) ** 2)
        slack = max(int(math.sqrt(rank * 0.25)), 1)
        assert rank <= int((got[~torch.isnan(got)] >= lo).sum()) <= rank + slack, (r, n)
        assert n_list < int(ok.sum())  # the bound cut the row


def _masked_past(x: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    col = torch.arange(x.shape[1])
    return torch.where(col[None, :] < ends.clamp(0, x.shape[1])[:, None].long(), x, torch.full_like(x, -INF))


ENDS_PATHS = [  # (launch keywords, k)
    pytest.param(({}, 40), id="resident"),
    pytest.param(({"resident_max": 8, "chunk": 32}, 9), id="stream"),
    # sample 16: rows of at most 32 columns taken whole, up to 16 sampled whole, longer ones in runs of 8
    pytest.param(({"plan": _plan(128, 6, 32, 64, slack=2)}, 9), id="list"),
    pytest.param(({"plan": _plan(128, 6, 32, 64, inline_select=False, reverse=False)}, 40), id="list-separate"),
    pytest.param(({"plan": _plan(128, 6, 16, 16)}, 40), id="list-fallback"),
    # a sample of 32: rows of at most 32 / 64 columns sample 8 / 16 of their scores
    pytest.param(({"plan": tk.ListPlan(sample=32, stride=16, rank=6, block=32, cap=64, chunk=32,
                                       scaled_sample=True)}, 9), id="list-scaled-sample"),
]


@pytest.mark.parametrize("path", ENDS_PATHS)
def test_row_ends(path):
    """With per-row ends a row is read only up to its end: the result is the
    top-k of the row with -inf past it (what the fused indexer relies on)."""
    kw, k = path
    gen = torch.Generator().manual_seed(11 + k)
    S = 128
    x = torch.cat([_special_rows(6, S, gen), torch.randn(6, S, generator=gen)])
    x[:, 120:] = 1e30  # past every end below: never selected
    ends = torch.tensor([120, 0, 40, 120, 7, 100, 3, -5, 17, 60, 119, 33], dtype=torch.int32)
    idx, lens = _run(x, k, ends=ends, **kw)
    ref_idx, ref_len = topk_contract(_masked_past(x, ends), k)
    assert torch.equal(lens, ref_len)
    assert torch.equal(idx, ref_idx)


# Each route through the public call (dsa.topk_indices, backend "triton"):
# launch's route keywords forced, the kinds launched with row ends recorded.
PUBLIC_ENDS_ROUTES = [  # (launch keywords, k, the route kind)
    pytest.param(({}, 40, "resident"), id="resident"),
    pytest.param(({"resident_max": 8, "chunk": 32}, 9, "stream"), id="stream"),
    pytest.param(({"plan": _plan(128, 6, 32, 64, slack=2, inline_select=True)}, 9, "list"), id="list-inline"),
    pytest.param(({"plan": _plan(128, 6, 32, 64, inline_select=False)}, 40, "list"), id="list-separate"),
    pytest.param(({"plan": _plan(128, 6, 16, 16)}, 9, "list"), id="list-fallback"),
    # the settings bench/topk_peers.py --variants sweeps: batches of 5 rows (the
    # ends indexed across batches), evict-first loads (the interpreter ignores
    # the hint: this checks the code path, the GPU run checks the compile)
    pytest.param(({"plan": _plan(128, 6, 32, 64, batch_rows=5, evict_first=True)}, 9, "list"),
                 id="list-batches-evict"),
    pytest.param(({"config": tk.ResidentConfig(4, search="interp", evict_first=True)}, 40, "resident"),
                 id="resident-evict"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("route", PUBLIC_ENDS_ROUTES)
def test_row_ends_public_each_route(route, dtype, monkeypatch):
    """topk_indices(..., row_ends=) on every route: the result is the top-k
    of each row up to its end, with +inf / NaN / huge values placed right
    past the ends (inside the 16-column group a vectorized load reads) and
    further on; ends of 0, S, past S, negative, not multiples of 16."""
    import functools

    import dsa

    kw, k, kind = route
    launched = []
    route_specs = tk.route_specs

    def recording(route, dtype, asm, has_end=False, l2_prefetch=False):
        if has_end:
            launched.append(route[0])
        return route_specs(route, dtype, asm, has_end, l2_prefetch)

    monkeypatch.setattr(tk, "launch", functools.partial(tk.launch, **kw))
    monkeypatch.setattr(tk, "route_specs", recording)
    gen = torch.Generator().manual_seed(31 + k)
    S = 128
    x = torch.cat([_special_rows(6, S, gen), torch.randn(6, S, generator=gen)])
    ends = torch.tensor([S, 0, 40, S + 9, 7, 100, 3, -5, 17, 60, 33, 2**31 - 1], dtype=torch.int32)
    ref_idx, ref_len = topk_contract(_masked_past(x, ends), k)
    for r, e in enumerate(ends.clamp(0, S).tolist()):
        x[r, e:] = torch.tensor([INF, NAN, 1e30])[torch.arange(S - e) % 3]
    x = x.to(dtype)
    idx, lens = dsa.topk_indices(x, k, row_ends=ends, return_lengths=True, backend="triton")
    assert launched == [kind]
    assert torch.equal(lens, ref_len)
    assert torch.equal(idx, ref_idx)


def test_env_settings_checked(monkeypatch):
    """The environment's sample sizes and warp counts must be powers of two
    (block shapes): anything else raises, naming the variable."""
    monkeypatch.setenv("DSA_TOPK_X", "8")
    assert tk._env_pow2("DSA_TOPK_X", 4) == 8
    monkeypatch.setenv("DSA_TOPK_X", "0")
    assert tk._env_pow2("DSA_TOPK_X", 4, zero=True) == 0
    for bad in ("0", "6", "-4"):
        monkeypatch.setenv("DSA_TOPK_X", bad)
        with pytest.raises(ValueError, match="DSA_TOPK_X must be a power of two"):
            tk._env_pow2("DSA_TOPK_X", 4)
    monkeypatch.delenv("DSA_TOPK_X")
    assert tk._env_pow2("DSA_TOPK_X", 4) == 4


def test_list_plan_sizes():
    """The plan's list fits k plus the sample's spread, and stays off where
    it would not pay (k near the row length)."""
    for S, k in [(16384, 2048), (32768, 1024), (65536, 2048), (131072, 64)]:
        p = tk._list_plan(S, k)
        fraction = 8 if S <= tk.LIST_ORDER_MAX_S else 16  # twice the sample up to 32768 keys
        assert p is not None and p.sample * fraction <= max(S, 1024 * fraction)
        mean = p.rank * S / p.sample
        assert k < mean <= p.block <= p.cap <= tk.LIST_MAX
        assert p.stride * (p.sample // 8 - 1) + 8 <= S
    assert tk._list_plan(16384, 9000) is None
    assert tk._list_plan(16384, 0) is None
    # twice the sample up to 32768 keys (1 / 8 of the row), then 1 / 16 up to 4096 scores
    assert [tk._list_plan(S, 1024).sample for S in (16384, 32768, 65536, 131072)] == [2048, 4096, 4096, 4096]


def test_list_plan_order_by_row_length(monkeypatch):
    """Unset, the build takes rows first first without L2 prefetch and with
    the whole sample up to LIST_ORDER_MAX_S keys, and last first with 4
    chunks ahead and a sample scaled to rows with ends above; the
    environment's values, when set, hold for every length."""
    monkeypatch.setattr(tk, "LIST_REVERSE", None)
    monkeypatch.setattr(tk, "LIST_PREFETCH", None)
    monkeypatch.setattr(tk, "LIST_SCALED_SAMPLE", None)
    for S, big in [(16384, False), (tk.LIST_ORDER_MAX_S, False), (65536, True), (131072, True)]:
        p = tk._list_plan(S, 1024)
        assert (p.reverse, p.prefetch, p.scaled_sample) == (big, 4 if big else 0, big), S
    monkeypatch.setattr(tk, "LIST_REVERSE", True)
    monkeypatch.setattr(tk, "LIST_PREFETCH", 2)
    monkeypatch.setattr(tk, "LIST_SCALED_SAMPLE", True)
    p = tk._list_plan(16384, 1024)
    assert (p.reverse, p.prefetch, p.scaled_sample) == (True, 2, True)
    monkeypatch.setattr(tk, "LIST_REVERSE", False)
    monkeypatch.setattr(tk, "LIST_SCALED_SAMPLE", False)
    p = tk._list_plan(65536, 1024)
    assert not p.reverse and not p.scaled_sample


def test_extremes_order():
    """Keys at the ends of the range: +-FLT_MAX, denormals, +inf, -inf, NaN."""
    tiny = torch.finfo(torch.float32).tiny
    big = torch.finfo(torch.float32).max
    row = torch.tensor([[-big, big, INF, -INF, NAN, tiny / 4, -tiny / 4, 0.0, -0.0, 1.0, -1.0, INF]])
    for k in range(1, 13):
        idx, lens = _run(row, k)
        ref_idx, ref_len = topk_contract(row, k)
        assert torch.equal(idx, ref_idx) and torch.equal(lens, ref_len), k


def test_strided_rows():
    """A row-sliced view (row stride != S) is read correctly."""
    gen = torch.Generator().manual_seed(3)
    base = torch.randint(-3, 4, (6, 50), generator=gen).float()
    view = base[:, :40]
    idx, lens = _run(view, 9, resident_max=tk.RESIDENT_MAX)
    ref_idx, ref_len = topk_contract(view, 9)
    assert torch.equal(idx, ref_idx) and torch.equal(lens, ref_len)


# Every threshold search of the resident kernel (ResidentConfig.search).
SEARCH_CONFIGS = [
    pytest.param(tk.ResidentConfig(4, search="radix", radix_bits=b), id=f"radix{b}") for b in (1, 2, 3, 4)
] + [
    pytest.param(tk.ResidentConfig(4, search="interp"), id="interp"),
    pytest.param(tk.ResidentConfig(4, search="interp", vec_load=False), id="interp-scalar"),
    pytest.param(tk.ResidentConfig(4, search="guess"), id="guess"),
]


def _extreme_rows(S: int, gen: torch.Generator) -> torch.Tensor:
    """Rows whose value statistics overflow fp32 (the first guess of interp),
    with +-FLT_MAX, denormals, a lone outlier and a block of +inf."""
    big = torch.finfo(torch.float32).max
    tiny = torch.finfo(torch.float32).tiny
    x = torch.randn(4, S, generator=gen)
    x[0, ::3] = big
    x[0, 1::3] = -big
    x[1] = x[1] * tiny  # denormals and tiny normals
    x[2, S // 2] = 1e30
    x[3, : S // 3] = INF
    return x


@pytest.mark.parametrize("cfg", SEARCH_CONFIGS)
@pytest.mark.parametrize("S,k", [(7, 3), (24, 0), (24, 1), (24, 12), (30, 31)])
def test_search_ties_nan_inf(cfg, S, k):
    gen = torch.Generator().manual_seed(S * 131 + k)
    x = torch.cat([_special_rows(6, S, gen), _extreme_rows(S, gen)])
    for rows in (x, x.half()):
        idx, lens = _run(rows, k, config=cfg)
        ref_idx, ref_len = topk_contract(rows, k)
        assert torch.equal(lens, ref_len), rows.dtype
        assert torch.equal(idx, ref_idx), rows.dtype


@pytest.mark.parametrize("cfg", SEARCH_CONFIGS)
def test_search_random_values(cfg):
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(5, 30, generator=gen) * 1e3
    x[1, 10:20] = x[1, 0]  # a tie run
    x[2] = torch.randint(-3, 3, (30,), generator=gen).float()
    x[3] = torch.empty(30).exponential_(generator=gen)  # skewed: the normal guess misses
    x[4] = (torch.randn(30, generator=gen) * 8).exp()
    for rows in (x, x.half()):
        for k in (1, 17):
            idx, lens = _run(rows, k, config=cfg)
            ref_idx, ref_len = topk_contract(rows, k)
            assert torch.equal(idx, ref_idx) and torch.equal(lens, ref_len), (rows.dtype, k)


def test_resident_config_checks():
    with pytest.raises(ValueError, match="search"):
        tk.ResidentConfig(4, search="sort")
    with pytest.raises(ValueError, match="radix_bits"):
        tk.ResidentConfig(4, search="radix", radix_bits=5)


def test_supports():
    assert tk.supports(TopkArgs(torch.zeros(2, 3), 2)) is None
    assert "fp32" in tk.supports(TopkArgs(torch.zeros(2, 3, dtype=torch.float64), 2))


@pytest.mark.gpu
@pytest.mark.parametrize("R,S,k", [(4096, 4096, 2048), (512, 16384, 2048), (64, 40000, 2048), (300, 3000, 4096),
                                   (256, 65536, 2048), (256, 65536, 1024), (96, 70000, 300)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gpu_contract(R, S, k, dtype):
    gen = torch.Generator(device="cuda").manual_seed(R + S)
    x = torch.randint(-200, 200, (R, S), device="cuda", generator=gen).float()  # ties
    x[:, ::97] = NAN
    x[:, 5::31] = -INF
    x[: R // 4, S // 3 :] = -INF  # short causal-like rows
    x = x.to(dtype)
    idx, lens = tk.topk(TopkArgs(x.contiguous(), k))
    ref_idx, ref_len = topk_contract(x, k)
    assert torch.equal(lens, ref_len)
    assert torch.equal(idx, ref_idx)


@pytest.mark.gpu
@pytest.mark.parametrize("S,k", [(65536, 2048), (65536, 1024), (32768, 2048), (16384, 1024)])
def test_gpu_list_path_randn_causal(S, k):
    """Long rows on the list path: randn rows, causal rows of every length,
    and special rows; with the default plan, then with a bound forced too
    high (every row through the streaming fallback) and lists forced over
    the capacity."""
    import dataclasses

    R = 384
    gen = torch.Generator(device="cuda").manual_seed(S + k)
    x = torch.randn(R, S, device="cuda", generator=gen)
    n = R // 2
    valid = (torch.arange(n, device="cuda") * (S // n) + torch.randint(0, 64, (n,), device="cuda", generator=gen))
    x[:n].masked_fill_(torch.arange(S, device="cuda")[None, :] > valid[:, None], -INF)
    x[n] = -INF
    x[n + 1] = 3.0  # all tied
    x[n + 2, ::3] = NAN
    x[n + 3, ::5] = INF
    x[n + 4, 1::2] = -0.0
    x[n + 4, ::2] = 0.0
    x[n + 5] = torch.randint(-3, 3, (S,), device="cuda", generator=gen).float()
    plan = tk._list_plan(S, k)
    ref_idx, ref_len = topk_contract(x, k)
    for p in (plan, dataclasses.replace(plan, rank=1), dataclasses.replace(plan, block=16, cap=16)):
        idx, lens = _run(x, k, plan=p)
        assert torch.equal(lens, ref_len), p
        assert torch.equal(idx, ref_idx), p
    idx, lens = tk.topk(TopkArgs(x, k))
    assert torch.equal(idx, ref_idx) and torch.equal(lens, ref_len)


# Compiled for sm_90a without a GPU, outside the interpreter: the resident
# kernel's default at 16384 keys, with and without the PTX store.
_AOT = r"""
import json, torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from dsa.triton import topk as tk
sig = {"s_ptr": "*fp32", "idx_ptr": "*i32", "len_ptr": "*i32", "S": "i32", "K": "i32", "stride_s": "i32",
       "stride_i": "i32"}
attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 5, 6)}  # as a launch on 16384 keys
cfg = tk._resident_config(16384)
out = {}
for asm in (True, False):
    const = dict(BLOCK_S=16384, FILL=1024, ASM_STORE=asm, **cfg.constexprs(torch.float32))
    c = triton.compile(ASTSource(tk._topk_resident_kernel, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=cfg.num_warps, maxnreg=cfg.maxnreg))
    out[str(asm)] = dict(converts=c.asm["ttgir"].count("ttg.convert_layout"), shared=c.metadata.shared,
                         st=c.asm["ptx"].count("st.global.b32"))
print(json.dumps(out))
"""


def test_ptx_store_keeps_the_load_layout():
    """With the PTX store the emit runs in the row load's layout: no layout
    conversion through shared memory (only the reductions' scratch); with
    tl.store the compiler converts (what ptx.store_i32 exists to avoid)."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=root)
    proc = subprocess.run([sys.executable, "-c", _AOT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["True"]["converts"] == 0 and got["True"]["shared"] <= 1024, got
    assert got["True"]["st"] >= 64, got  # one predicated store for each of a thread's 64 keys
    assert got["False"]["converts"] > 0 and got["False"]["shared"] > got["True"]["shared"], got


_AOT_LIST = r"""
import dataclasses, json, sys, torch, triton
from dsa.triton import fit, topk as tk
p = tk._list_plan(65536, 2048)
out = {}
for cap in (80, 90, 100, 120):
    for has_end, scaled in ((False, False), (True, False), (True, True)):
        q = dataclasses.replace(p, scaled_sample=scaled)
        spec = tk.route_specs(("list", q), torch.float32, True, has_end, l2_prefetch=cap >= 90)[0]
        src = fit._source(spec)  # S and the row stride 16-divisible, as a launch on 65536 columns specializes them
        src.attrs.update({(spec.fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in ("S", "stride_s")})
        c = triton.compile(src, target=fit.Target.of(cap).gpu_target(), options=fit._options(spec))
        out[f"{cap}/{has_end}/{scaled}"] = dict(converts=c.asm["ttgir"].count("ttg.convert_layout"),
                                       v4=c.asm["ptx"].count("ld.global.v4"),
                                       prefetch=c.asm["ptx"].count("cp.async.bulk.prefetch.L2"))
print(json.dumps(out))
"""


def test_list_build_compiles_for_every_arch():
    """The list build kernel compiles for sm_80 / 90 / 100 / 120 with 16-byte
    row loads and its stores in the load's layout (no layout conversion),
    with and without row ends (and the scaled sample), and from sm_90 on
    with the L2 prefetch."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=root)
    proc = subprocess.run([sys.executable, "-c", _AOT_LIST], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for cap, c in got.items():
        assert c["converts"] == 0 and c["v4"] >= 2, (cap, c)
        assert (c["prefetch"] > 0) == (int(cap.split("/")[0]) >= 90), (cap, c)


# The routes against made-up shared-memory limits (sm_90 otherwise): the
# resident kernel at 16384 keys needs 2048 B, the streaming one 1024 B.
_FIT = r"""
import json, torch
from dsa.triton import fit, topk as tk
out = {}
for S, limit in ((16384, 232448), (16384, 1500), (16384, 600), (65536, 232448)):
    # rows of 16384 keys take the resident kernel where the list path is off
    route, why = tk.pick(S, 2048, torch.float32, fit.Target(90, fit.DeviceLimits(90, limit)),
                         list_min=tk.LIST_MIN if S > 16384 else 1 << 30)
    specs = tk.route_specs(route, torch.float32, True) if route else []
    need = [fit.shared_bytes(s, fit.Target.of(90)) for s in specs]
    out[f"{S}/{limit}"] = [route and route[0], route and repr(route[1]), why, need]
print(json.dumps(out))
"""


def test_the_first_route_that_fits_the_limits_runs():
    """Where the resident kernel's shared memory is over the limit the
    streaming kernel takes its rows; where nothing fits, the reason names
    the limit; at the real sm_90 limit the measured routes stay."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=root)
    proc = subprocess.run([sys.executable, "-c", _FIT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    kind, cfg, why, need = got["16384/232448"]
    assert kind == "resident" and cfg == repr((16384, tk._resident_config(16384))) and why == "", got
    assert 1500 < max(need) <= 232448, got
    kind, cfg, why, need = got["16384/1500"]
    assert (kind, cfg, why) == ("stream", "4096", "") and max(need) <= 1500, got
    kind, _, why, _ = got["16384/600"]
    assert kind is None and "does not fit sm_90's 600 B" in why, got
    kind, cfg, why, need = got["65536/232448"]
    assert kind == "list" and cfg == repr(tk._list_plan(65536, 2048)) and len(need) == 4, got


def test_tiles_reason_without_a_device_limit():
    """Off CUDA (the interpreter) there is no limit to fit: no reason, and the
    backend hook hands out the op."""
    from dsa import triton as backend

    a = TopkArgs(torch.zeros(2, 40), 3)
    assert tk.tiles_reason("topk", a) is None
    assert backend.backend_op("topk", a) is tk.topk
    assert tk.pick(40, 3, torch.float32, None) == (("resident", (64, tk._resident_config(64))), "")


def test_ptx_enabled_only_on_nvidia():
    from dsa.triton import ptx

    assert not ptx.enabled(torch.zeros(1))
    if torch.cuda.is_available():
        assert ptx.enabled(torch.zeros(1, device="cuda")) == (torch.version.hip is None)


# --------------------------------------------------------------------------
# The fused indexer_topk's chunking (dsa/triton/indexer.py): chunks in
# rotating buffers, top-k read up to each row's window end.


def _packed_indexer_args(ratio, causal):
    from dsa._args import IndexerArgs

    gen = torch.Generator().manual_seed(21 + ratio)
    sq, sk, offs = [5, 0, 7, 3], [9, 4, 12, 0], [3, 0, 6, 2]
    Tq, Tk, H, D = sum(sq), sum(sk), 4, 16
    cu = lambda n: torch.tensor([0] + torch.tensor(n).cumsum(0).tolist(), dtype=torch.int32)  # noqa: E731
    return IndexerArgs(q=torch.randint(-2, 3, (Tq, H, D), generator=gen).float(),
                       k=torch.randint(-2, 3, (Tk, D), generator=gen).float(),
                       weights=torch.randint(-2, 3, (Tq, H), generator=gen).float() * 0.5,
                       cu_seqlens_q=cu(sq), cu_seqlens_k=cu(sk), q_offsets=torch.tensor(offs, dtype=torch.int64),
                       max_seqlen_k=14, ratio=ratio, causal=causal, sm_scale=0.5)


@pytest.mark.parametrize("buffers,row_ends,ratio,causal", [(1, False, 1, True), (2, True, 2, True),
                                                           (3, True, 1, False)])
def test_indexer_topk_chunks(buffers, row_ends, ratio, causal, monkeypatch):
    """indexer_topk in chunks of 2 rows (through sequences) over 1-3 buffers,
    with and without row ends, equals the contract's top-k of the reference
    scores (integer inputs: real ties); the row ends are the windows."""
    from dsa import reference
    from dsa.triton import indexer as ix

    a = _packed_indexer_args(ratio, causal)
    ref = reference.indexer_scores(a)
    ends = ix.row_ends(a)
    assert torch.equal(ends, (ref != -INF).sum(1).int())  # integer scores inside a window are finite
    monkeypatch.setattr(ix, "chunk_rows", lambda Tq, S, k: 2)
    monkeypatch.setattr(ix, "TOPK_BUFFERS", buffers)
    monkeypatch.setattr(ix, "TOPK_ROW_ENDS", row_ends)
    for k in (3, 20):
        idx, lens = ix.indexer_topk(a, k)
        ref_idx, ref_len = topk_contract(ref, k)
        assert torch.equal(lens, ref_len) and torch.equal(idx, ref_idx), k


@pytest.mark.gpu
@pytest.mark.parametrize("S,k", [(65536, 2048), (32768, 1024)])
def test_gpu_list_path_row_ends(S, k):
    """The list path with row ends on the GPU (inline select or not, L2
    prefetch or not): rows of every length up to S, garbage past each end."""
    import dataclasses

    R = 256
    gen = torch.Generator(device="cuda").manual_seed(S - k)
    x = torch.randn(R, S, device="cuda", generator=gen)
    plan = tk._list_plan(S, k)
    ends = torch.randint(0, S + 1, (R,), device="cuda", generator=gen, dtype=torch.int32)
    special = [0, 1, k - 1, k, k + 1, plan.block - 1, plan.block, plan.block + 1, plan.sample + 3, S - 1, S, S + 9]
    ends[: len(special)] = torch.tensor(special, dtype=torch.int32)
    x[R - 1] = torch.randint(-3, 3, (S,), device="cuda", generator=gen).float()  # ties
    ref_idx, ref_len = topk_contract(_masked_past(x.cpu(), ends.cpu()).cuda(), k)
    for p in (plan, dataclasses.replace(plan, inline_select=False, reverse=False, build_maxnreg=None),
              dataclasses.replace(plan, prefetch=0), dataclasses.replace(plan, scaled_sample=True)):
        idx, lens = _run(x, k, plan=p, ends=ends)
        assert torch.equal(lens, ref_len) and torch.equal(idx, ref_idx), p


@pytest.mark.gpu
@pytest.mark.parametrize("S,k", [(4096, 2048), (16384, 2048), (16384, 1024), (65536, 2048)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_row_ends_public(S, k, dtype):
    """topk_indices(..., row_ends=) on the GPU: causal and random ends,
    +inf / NaN right past every end, each row's result that of the row
    with -inf past its end; then the short-row settings of the environment
    (evict-first loads, batches, a larger sample, more warps) on the route."""
    import dataclasses

    import dsa

    R = 512
    gen = torch.Generator(device="cuda").manual_seed(S + k)
    x = torch.randn(R, S, device="cuda", generator=gen)
    x[-1] = torch.randint(-3, 3, (S,), device="cuda", generator=gen).float()  # ties
    ends = torch.randint(-4, S + 9, (R,), device="cuda", generator=gen, dtype=torch.int32)
    ends[: R // 2] = torch.linspace(1, S, R // 2, device="cuda").int()  # causal-like
    col = torch.arange(S, device="cuda")
    past = col[None, :] >= ends.clamp(0, S)[:, None]
    poison = torch.where(col % 2 == 0, INF, NAN).expand(R, S)
    ref_idx, ref_len = topk_contract(torch.where(past, -INF, x).to(dtype), k)
    x = torch.where(past, poison, x).to(dtype)
    idx, lens = dsa.topk_indices(x, k, row_ends=ends, return_lengths=True, backend="triton")
    assert torch.equal(lens, ref_len) and torch.equal(idx, ref_idx)
    idx, lens = dsa.topk_indices(x, k, row_ends=ends.long(), return_lengths=True, backend="triton")
    assert torch.equal(lens, ref_len) and torch.equal(idx, ref_idx)
    plan = tk._list_plan(S, k) if S >= tk.LIST_MIN else None
    if plan is None:
        settings = [{"config": dataclasses.replace(tk._resident_config(S), evict_first=True)}]
    else:
        settings = [{"plan": dataclasses.replace(plan, batch_rows=100, evict_first=True)},
                    {"plan": tk._list_plan(S, k, sample=2 * plan.sample)},
                    {"plan": dataclasses.replace(plan, select_warps=8, select_maxnreg=None, build_warps=8)},
                    {"plan": dataclasses.replace(plan, build_warps=2)},
                    {"plan": dataclasses.replace(plan, scaled_sample=True)}]
    for kw in settings:
        idx, lens = _run(x, k, ends=ends, **kw)
        assert torch.equal(lens, ref_len) and torch.equal(idx, ref_idx), kw


@pytest.mark.gpu
def test_gpu_indexer_topk_long_rows(monkeypatch):
    """The fused indexer_topk on the list path (20000 keys), in 7 chunks over
    2 buffers and streams with row ends, equals the top-k of the full score
    matrix, and the path without buffers or row ends."""
    from dsa._args import IndexerArgs
    from dsa.triton import indexer as ix

    T, H, D = 20000, 16, 64
    g = torch.Generator(device="cuda").manual_seed(3)
    cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    a = IndexerArgs(q=torch.randn(T, H, D, device="cuda", generator=g).bfloat16(),
                    k=torch.randn(T, D, device="cuda", generator=g).bfloat16(),
                    weights=torch.randn(T, H, device="cuda", generator=g).bfloat16(), cu_seqlens_q=cu,
                    cu_seqlens_k=cu, q_offsets=torch.zeros(1, dtype=torch.int64, device="cuda"), max_seqlen_k=T,
                    ratio=1, causal=True, sm_scale=D**-0.5)
    full = tk.topk(TopkArgs(ix.scores(a), 2048))
    monkeypatch.setattr(ix, "chunk_rows", lambda Tq, S, k: 3000)
    for buffers, ends in ((2, True), (1, False)):
        monkeypatch.setattr(ix, "TOPK_BUFFERS", buffers)
        monkeypatch.setattr(ix, "TOPK_ROW_ENDS", ends)
        idx, lens = ix.indexer_topk(a, 2048)
        assert torch.equal(idx, full[0]) and torch.equal(lens, full[1]), (buffers, ends)
