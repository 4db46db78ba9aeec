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

Indexer training (cudnn-frontend >= 1.32, batched [B, S, ...] tensors, -1
for an invalid slot): ``sparse_attn_score_recompute_wrapper(q, kv, lse,
topk_indices, softmax_scale, qhead_per_kv_head=H)`` -> {"target"};
``sparse_indexer_score_recompute_wrapper(q_i, k_i, weights, topk_indices)``
-> {"predict"} (the softmax over the slots; no sm_scale argument: the weights
carry it); ``indexer_backward_wrapper(q_i, weights, k_i, attn_score,
index_score, topk_indices, grad_loss, sm_scale=, loss_coeff=)`` ->
{"d_index_q", "d_weights", "d_index_k"} (it overwrites ``attn_score``, and
scales by loss_coeff / (B * S_q): the mean over rows). Both indexer wrappers
take bf16 weights only (``check_support``: "W dtype mismatch"), and return
bf16 dq, dweights and dk: :func:`indexer_weights` makes the two bf16 weight
tensors once, so a benchmark can keep the casts out of its timing.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

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


# --------------------------------------------------------------------------
# indexer training (packed dsa tensors are passed as one batch)


def attention_target(q, kv, indices, lse, *, sm_scale):
    """q [T, H, D], kv [N, D], indices [T, K], lse [T, H] -> target [T, K]."""
    res = wrapper("sparse_attn_score_recompute_wrapper")(
        q.unsqueeze(0), kv.unsqueeze(0), lse.unsqueeze(0), indices.unsqueeze(0), sm_scale,
        qhead_per_kv_head=q.shape[1],
    )
    return res["target"][0]


def indexer_weights(weights, sm_scale):
    """(weights, weights * sm_scale), both bf16: what the backward and the
    softmax recompute take (the recompute has no sm_scale argument; the scale
    is applied in fp32 before the one rounding)."""
    return weights.to(torch.bfloat16), (weights.float() * sm_scale).to(torch.bfloat16)


def indexer_softmax(q_i, k_i, weights, indices, *, sm_scale, scaled_weights=None):
    """The softmax of the indexer logits over the slots [T, K]: the wrapper is
    given ``scaled_weights`` (bf16 weights * sm_scale; made here when None)."""
    if scaled_weights is None:
        scaled_weights = indexer_weights(weights, sm_scale)[1]
    res = wrapper("sparse_indexer_score_recompute_wrapper")(
        q_i.unsqueeze(0), k_i.unsqueeze(0), scaled_weights.unsqueeze(0), indices.unsqueeze(0),
        qhead_per_kv_head=q_i.shape[1],
    )
    return res["predict"][0]


def indexer_kl_step(q_i, k_i, weights, indices, target, *, sm_scale, scaled_weights=None, grad_loss=None):
    """cuDNN's KL training step: the softmax recompute, then the indexer
    backward -> (dq_i, dk_i, dweights), bf16. ``target`` [T, K] is
    overwritten. ``weights`` must be bf16 unless ``scaled_weights`` is None
    (then both are made from it here, inside the caller's timing)."""
    if scaled_weights is None:
        weights, scaled_weights = indexer_weights(weights, sm_scale)
    predict = indexer_softmax(q_i, k_i, weights, indices, sm_scale=sm_scale, scaled_weights=scaled_weights)
    if grad_loss is None:
        grad_loss = torch.ones(1, device=q_i.device, dtype=torch.float32)
    res = wrapper("indexer_backward_wrapper")(
        q_i.unsqueeze(0), weights.unsqueeze(0), k_i.unsqueeze(0), target.unsqueeze(0), predict.unsqueeze(0),
        indices.unsqueeze(0), grad_loss, sm_scale=sm_scale, loss_coeff=1.0,
    )
    return res["d_index_q"][0], res["d_index_k"][0], res["d_weights"][0]
