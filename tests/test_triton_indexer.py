"""Kernel tests of dsa/triton/indexer.py against an independent float64 indexer.

CPU: the Triton interpreter on tiny ragged packed batches (a length-0 key
sequence, a length-0 and a length-1 query sequence, nonzero q_offsets,
ratio 1/3/4, causal and not), fp32 and fp16. GPU (``gpu`` marker): H_i=64,
D_i=128 in bf16 and fp16, and indexer_topk == topk(scores) at realistic sizes.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import pytest  # noqa: E402

from dsa._args import IndexerArgs, TopkArgs  # noqa: E402
from dsa.triton import indexer as ix  # noqa: E402
from dsa.triton import topk as tk  # noqa: E402

from tests.test_triton_topk import topk_contract  # noqa: E402

INF = float("inf")


def scores_f64(a: IndexerArgs) -> torch.Tensor:
    """The contract in float64, one sequence (and query chunk) at a time."""
    cu_q = a.cu_seqlens_q.tolist()
    cu_k = a.cu_seqlens_k.tolist()
    offs = a.q_offsets.tolist()
    Tq = a.q.shape[0]
    out = torch.full((Tq, a.max_seqlen_k), -INF, dtype=torch.float64, device=a.q.device)
    for b in range(a.batch):
        s_k = cu_k[b + 1] - cu_k[b]
        kb = a.k[cu_k[b] : cu_k[b + 1]].double()
        for c0 in range(cu_q[b], cu_q[b + 1], 256):
            c1 = min(c0 + 256, cu_q[b + 1])
            i = torch.arange(c0 - cu_q[b], c1 - cu_q[b], device=a.q.device)
            if a.causal:
                end = torch.div(offs[b] + i + 1, a.ratio, rounding_mode="floor").clamp(0, s_k)
            else:
                end = torch.full_like(i, s_k)
            dots = torch.einsum("thd,jd->thj", a.q[c0:c1].double(), kb).clamp_min(0)
            s = a.sm_scale * torch.einsum("th,thj->tj", a.weights[c0:c1].double(), dots)
            vis = torch.arange(s_k, device=a.q.device)[None, :] < end[:, None]
            out[c0:c1, :s_k] = torch.where(vis, s, torch.full_like(s, -INF))
    return out


def make_args(sq, sk, offs, H, D, dtype, w_dtype, ratio, causal, sm_scale=0.3, integer=False,
              device="cpu", max_seqlen_k=None, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    Tq, Tk = sum(sq), sum(sk)
    if integer:  # exact in every dtype and in fp32 accumulation: ties are real ties
        q = torch.randint(-2, 3, (Tq, H, D), generator=gen, device=device).to(dtype)
        k = torch.randint(-2, 3, (Tk, D), generator=gen, device=device).to(dtype)
        w = torch.randint(-2, 3, (Tq, H), generator=gen, device=device).to(w_dtype) * 0.5
    else:
        q = torch.randn((Tq, H, D), generator=gen, device=device).to(dtype)
        k = torch.randn((Tk, D), generator=gen, device=device).to(dtype)
        w = torch.randn((Tq, H), generator=gen, device=device).to(w_dtype)
    cu = lambda n: torch.tensor([0] + list(torch.tensor(n).cumsum(0).tolist()), dtype=torch.int32, device=device)
    return IndexerArgs(
        q=q, k=k, weights=w, cu_seqlens_q=cu(sq), cu_seqlens_k=cu(sk),
        q_offsets=torch.tensor(offs, dtype=torch.int32, device=device),
        max_seqlen_k=max_seqlen_k if max_seqlen_k is not None else max(sk) + 3,
        ratio=ratio, causal=causal, sm_scale=sm_scale,
    )


def check_scores(got: torch.Tensor, ref: torch.Tensor, a: IndexerArgs, rtol: float) -> None:
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert torch.equal(torch.isneginf(got), torch.isneginf(ref)), "-inf pattern differs"
    fin = torch.isfinite(ref)
    assert torch.isfinite(got[fin]).all()
    # |score| can cancel (weights of both signs): bound the error by the sum of |terms|.
    mag = torch.zeros_like(ref)
    absargs = IndexerArgs(a.q.abs(), a.k.abs(), a.weights.abs(), a.cu_seqlens_q, a.cu_seqlens_k,
                          a.q_offsets, a.max_seqlen_k, a.ratio, a.causal, abs(a.sm_scale))
    mag = scores_f64(absargs)
    err = (got.double() - ref)[fin].abs()
    assert (err <= rtol * mag[fin] + 1e-30).all(), f"max err {err.max().item():.3e}"


# Sequences: a length-1 query sequence, a length-0 key sequence, a length-0 query sequence.
RAGGED = dict(sq=[6, 1, 9, 4, 0, 8], sk=[7, 3, 0, 5, 2, 10], offs=[1, 0, 4, 2, 0, 30])

CPU_CASES = [
    pytest.param(3, 16, 1, True, id="H3D16-r1-causal"),
    pytest.param(4, 32, 3, True, id="H4D32-r3-causal"),
    pytest.param(4, 16, 4, True, id="H4D16-r4-causal"),
    pytest.param(3, 32, 4, False, id="H3D32-r4-full"),
    pytest.param(4, 16, 1, False, id="H4D16-r1-full"),
]
DTYPES = [
    pytest.param(torch.float32, torch.float32, 1e-5, id="fp32"),
    pytest.param(torch.float16, torch.float16, 1e-4, id="fp16"),
    pytest.param(torch.float16, torch.float32, 1e-4, id="fp16-w32"),
]


@pytest.mark.parametrize("H,D,ratio,causal", CPU_CASES)
@pytest.mark.parametrize("dtype,w_dtype,rtol", DTYPES)
def test_scores(H, D, ratio, causal, dtype, w_dtype, rtol):
    a = make_args(**RAGGED, H=H, D=D, dtype=dtype, w_dtype=w_dtype, ratio=ratio, causal=causal, seed=H * D + ratio)
    check_scores(ix.scores(a), scores_f64(a), a, rtol)


@pytest.mark.parametrize("H,D,ratio,causal", CPU_CASES)
@pytest.mark.parametrize(
    "dtype,chunk",
    [(torch.float32, None), (torch.float32, 5), (torch.float16, 5)],
    ids=["fp32-one-chunk", "fp32-chunks-of-5", "fp16-chunks-of-5"],
)
def test_indexer_topk(H, D, ratio, causal, dtype, chunk, monkeypatch):
    """Integer inputs: exact scores with many ties. indexer_topk must equal the
    contract on the float64 scores, and topk(scores(a)) bit for bit."""
    if chunk is not None:  # chunks that cut through sequences
        monkeypatch.setattr(ix, "chunk_rows", lambda Tq, S, k: chunk)
    a = make_args(**RAGGED, H=H, D=D, dtype=dtype, w_dtype=dtype, ratio=ratio, causal=causal,
                  integer=True, sm_scale=0.5, seed=ratio + D)
    ref = scores_f64(a)
    got = ix.scores(a)
    assert torch.equal(got.double(), ref)  # exact inputs: exact scores
    for k in (4, 11):  # 11 > every S_k: padded rows
        idx, lens = ix.indexer_topk(a, k)
        ref_idx, ref_len = topk_contract(ref, k)
        assert torch.equal(lens, ref_len), k
        assert torch.equal(idx, ref_idx), k
        sidx, slen = tk.topk(TopkArgs(got, k))
        assert torch.equal(idx, sidx) and torch.equal(lens, slen)


def test_single_sequence_and_wide_columns():
    """B=1 (the batched layout's reduction) with max_seqlen_k far past S_k."""
    a = make_args([13], [11], [0], H=4, D=16, dtype=torch.float32, w_dtype=torch.float32,
                  ratio=1, causal=True, max_seqlen_k=40)
    check_scores(ix.scores(a), scores_f64(a), a, 1e-5)


@pytest.mark.parametrize("chunk", [None, 4])
def test_single_sequence_chunks(chunk, monkeypatch):
    """One sequence (its kernel has no block table) with a query offset,
    ratio 2 and query chunks that do not divide it."""
    if chunk is not None:
        monkeypatch.setattr(ix, "chunk_rows", lambda Tq, S, k: chunk)
    a = make_args([13], [9], [3], H=4, D=16, dtype=torch.float32, w_dtype=torch.float32, ratio=2, causal=True,
                  integer=True, sm_scale=0.5, seed=7)
    ref = scores_f64(a)
    assert torch.equal(ix.scores(a).double(), ref)
    for k in (3, 10):
        idx, lens = ix.indexer_topk(a, k)
        ref_idx, ref_len = topk_contract(ref, k)
        assert torch.equal(lens, ref_len) and torch.equal(idx, ref_idx), k


def test_many_sequences(monkeypatch):
    """More sequences than one step of the block-table kernel (carry across steps)."""
    monkeypatch.setattr(ix, "_TABLE_BLOCK", 16)
    sq = [(3 * b) % 4 for b in range(40)]
    sk = [(5 * b) % 6 for b in range(40)]
    a = make_args(sq, sk, [b % 3 for b in range(40)], H=4, D=16, dtype=torch.float32,
                  w_dtype=torch.float32, ratio=1, causal=True)
    check_scores(ix.scores(a), scores_f64(a), a, 1e-5)


def test_supports():
    a = make_args([2], [2], [0], H=4, D=16, dtype=torch.float32, w_dtype=torch.float32, ratio=1, causal=True)
    assert ix.supports(a) is None
    bad_k = IndexerArgs(a.q, a.k.half(), a.weights, a.cu_seqlens_q, a.cu_seqlens_k, a.q_offsets, 3, 1, True, 1.0)
    assert "dtype" in ix.supports(bad_k)
    many = IndexerArgs(torch.zeros(2, 300, 16), a.k, torch.zeros(2, 300), a.cu_seqlens_q, a.cu_seqlens_k,
                       a.q_offsets, 3, 1, True, 1.0)
    assert "heads" in ix.supports(many)


def test_head_limits():
    """The scores kernel serves up to fit.MAX_SCORE_HEADS heads; the indexer
    backward and training kernels hold a row's heads as MMA rows and decline
    past fit.MAX_ROW_HEADS, saying so (auto then takes the reference)."""
    from dsa._args import SparseIndexerArgs
    from dsa.triton import fit, indexer_bwd, training

    assert (fit.MAX_SCORE_HEADS, fit.MAX_ROW_HEADS) == (256, 128)
    a = make_args([2], [2], [0], H=4, D=16, dtype=torch.float32, w_dtype=torch.float32, ratio=1, causal=True)

    def heads(H):
        return IndexerArgs(torch.zeros(2, H, 16), a.k, torch.zeros(2, H), a.cu_seqlens_q, a.cu_seqlens_k,
                           a.q_offsets, 3, 1, True, 1.0)

    for H in (fit.MAX_ROW_HEADS, fit.MAX_ROW_HEADS + 64, fit.MAX_SCORE_HEADS):
        assert ix.supports(heads(H)) is None, H
        why = indexer_bwd.supports(heads(H))
        assert (why is None) == (H <= fit.MAX_ROW_HEADS), (H, why)
        sp = SparseIndexerArgs(torch.zeros(2, H, 16), torch.zeros(5, 16), torch.zeros(2, H),
                               torch.zeros(2, 3, dtype=torch.int32), None, 1.0)
        assert (training.supports(sp) is None) == (H <= fit.MAX_ROW_HEADS), H
        if why is not None:
            assert str(fit.MAX_ROW_HEADS) in why and str(H) in why
    assert "heads" in ix.supports(heads(fit.MAX_SCORE_HEADS + 1))


# ----------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------

GPU_RAGGED = dict(sq=[1500, 1, 700, 0, 1025], sk=[1600, 0, 190, 64, 1030], offs=[200, 0, 60, 0, 3])


def _scores_near_f64(a: IndexerArgs) -> torch.Tensor:
    """The kernel's scores of ``a``, checked against float64: the same -inf
    pattern, 1e-3 rel L2 over the finite ones."""
    got = ix.scores(a)
    ref = scores_f64(a)
    assert torch.equal(torch.isneginf(got), torch.isneginf(ref))
    fin = torch.isfinite(ref)
    rel = (got.double()[fin] - ref[fin]).norm() / ref[fin].norm()
    assert rel < 1e-3, rel.item()
    return got


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ratio,causal", [(1, True), (4, True), (1, False)])
def test_gpu_scores(dtype, ratio, causal):
    sk = GPU_RAGGED["sk"] if ratio == 1 else [s // 4 + 1 for s in GPU_RAGGED["sk"]]
    a = make_args(GPU_RAGGED["sq"], sk, GPU_RAGGED["offs"], H=64, D=128, dtype=dtype, w_dtype=torch.float32,
                  ratio=ratio, causal=causal, sm_scale=128**-0.5, device="cuda")
    got = _scores_near_f64(a)
    # top-k of the kernel's scores follows the contract (plain torch on the same scores)
    idx, lens = tk.topk(TopkArgs(got, 512))
    ref_idx, ref_len = topk_contract(got, 512)
    assert torch.equal(idx, ref_idx) and torch.equal(lens, ref_len)


def test_scores_tiles_by_head_count():
    """64 heads or more take the two-warpgroup tiles, fewer the one-warpgroup
    ones, fp32 its own: one choice per dtype and head count, so indexer_topk's
    chunks compute what scores() does."""
    def tiles(H, dtype):
        a = make_args([3], [3], [0], H=H, D=16, dtype=dtype, w_dtype=torch.float32, ratio=1, causal=True)
        return ix._CONFIGS[ix._class(a)]

    assert tiles(64, torch.bfloat16) == tiles(128, torch.float16) == ix._CONFIGS["mma"]
    assert tiles(32, torch.bfloat16) == tiles(16, torch.float16) == ix._CONFIGS["mma_narrow"]
    assert tiles(64, torch.float32) == ix._CONFIGS["fp32"]
    assert ix._CONFIGS["mma"].num_warps == 8 and ix._CONFIGS["mma_narrow"].num_warps == 4


@pytest.mark.gpu
@pytest.mark.parametrize("H,D", [(16, 128), (32, 128), (64, 64), (128, 128)])
def test_gpu_scores_head_counts(H, D):
    """Both tile classes against float64 on ragged causal batches."""
    a = make_args(GPU_RAGGED["sq"], GPU_RAGGED["sk"], GPU_RAGGED["offs"], H=H, D=D, dtype=torch.bfloat16,
                  w_dtype=torch.float32, ratio=1, causal=True, sm_scale=D**-0.5, device="cuda")
    _scores_near_f64(a)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("chunk", [None, 1000])
def test_gpu_indexer_topk(dtype, chunk, monkeypatch):
    if chunk is not None:
        monkeypatch.setattr(ix, "chunk_rows", lambda Tq, S, k: chunk)
    a = make_args([4096, 3000], [1024, 900], [0, 1000], H=64, D=128, dtype=dtype, w_dtype=dtype,
                  ratio=4, causal=True, sm_scale=128**-0.5, device="cuda")
    s = ix.scores(a)
    for k in (512, 2048):
        idx, lens = ix.indexer_topk(a, k)
        sidx, slen = tk.topk(TopkArgs(s, k))
        assert torch.equal(idx, sidx) and torch.equal(lens, slen)
    # integer-valued inputs: exact scores, heavy ties
    a = make_args([2048, 700], [2048, 100], [0, 5], H=64, D=128, dtype=dtype, w_dtype=dtype, ratio=1,
                  causal=True, sm_scale=0.5, integer=True, device="cuda")
    idx, lens = ix.indexer_topk(a, 256)
    ref_idx, ref_len = topk_contract(scores_f64(a), 256)
    assert torch.equal(idx, ref_idx) and torch.equal(lens, ref_len)
