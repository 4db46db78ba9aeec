"""Peer "cudnn": the cuDNN frontend's DSA kernels (package nvidia-cudnn-frontend).

Optional and experimental on NVIDIA's side (``cudnn.DSA``, "subject to
change"), so this adapter is deliberately thin: each op looks its wrapper up
by name and the benchmark skips, with the reason, when the package, the
``DSA`` namespace or the wrapper is missing, or when the first call raises
(most of its kernels are SM100-only). Nothing here runs at import time.

Wrappers used (cudnn-frontend >= 1.27 naming):
``sparse_attention_forward_wrapper(q, kv, topk_idxs, *, attn_sink,
topk_length, softmax_scale)`` -> {"out", "lse", ...};
``sparse_attention_backward_wrapper(q, kv, out, d_out, lse, attn_sink,
topk_idxs, *, softmax_scale, topk_length)`` -> {"dq", "dkv", "d_sink"};
``indexer_forward_wrapper(q, k, w, ratio=, sm_scale=)`` -> {"scores"};
``indexer_top_k_wrapper(scores, seq_lens, top_k, next_n=1, return_val=False)``
-> {"indices"} (cuDNN's own order: not sorted, not -1 padded).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

# A score matrix above this is not composed from indexer + top-k (the fused
# cuDNN path is SM100-only and not wired here).
MAX_SCORE_MATRIX_BYTES = 4 << 30


def unavailable() -> Optional[str]:
    """Why the cuDNN frontend DSA peer cannot run here (None if it may)."""
    try:
        import cudnn  # noqa: F401
    except ImportError as e:
        return f"cudnn: cuDNN frontend not installed (pip install nvidia-cudnn-frontend): {e}"
    except Exception as e:  # a broken install must not break the suite
        return f"cudnn: importing the cuDNN frontend failed: {type(e).__name__}: {e}"
    if _dsa() is None:
        version = getattr(cudnn, "__version__", "?")
        return f"cudnn: cuDNN frontend {version} has no DSA module (cudnn.DSA)"
    return None


def _dsa() -> Any:
    import cudnn

    dsa = getattr(cudnn, "DSA", None)
    if dsa is None:
        try:
            from cudnn import deepseek_sparse_attention as dsa  # type: ignore[no-redef]
        except Exception:
            return None
    return dsa


def wrapper(name: str) -> Callable[..., Any]:
    """The ``cudnn.DSA`` wrapper ``name``; raises LookupError naming it."""
    try:
        fn = getattr(_dsa(), name)
    except AttributeError:
        fn = None
    if fn is None:
        raise LookupError(f"cudnn.DSA has no {name}")
    return fn


def sparse_attention_fwd(q, kv, indices, *, sm_scale, d_v, sink=None, topk_length=None):
    res = wrapper("sparse_attention_forward_wrapper")(
        q, kv, indices, attn_sink=sink, topk_length=topk_length, softmax_scale=sm_scale
    )
    return res["out"][..., :d_v], res["lse"]


def sparse_attention_fwd_bwd(q, kv, indices, dout, *, sm_scale, d_v, sink=None, topk_length=None):
    out, lse = sparse_attention_fwd(
        q, kv, indices, sm_scale=sm_scale, d_v=d_v, sink=sink, topk_length=topk_length
    )
    res = wrapper("sparse_attention_backward_wrapper")(
        q, kv, out, dout, lse, sink, indices, softmax_scale=sm_scale, topk_length=topk_length
    )
    return res["dq"], res["dkv"]


def indexer_scores(q, k, weights, *, ratio, sm_scale=1.0):
    """Batched q [B,S_q,H,D], k [B,S_k,D] (passed as [B,S_k,1,D]), causal."""
    res = wrapper("indexer_forward_wrapper")(q, k.unsqueeze(2), weights, ratio=ratio, sm_scale=sm_scale)
    return res["scores"]


def topk_indices(scores, k, seq_lens):
    res = wrapper("indexer_top_k_wrapper")(scores, seq_lens, k, next_n=1, return_val=False)
    return res["indices"]


def indexer_topk(q, k, weights, topk, seq_lens, *, ratio, sm_scale=1.0):
    """Indexer then top-k (materialises the score matrix: small shapes only)."""
    scores = indexer_scores(q, k, weights, ratio=ratio, sm_scale=sm_scale)
    return topk_indices(scores.flatten(0, 1), topk, seq_lens)
