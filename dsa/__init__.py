"""dsa: DeepSeek Sparse Attention kernels.

    from dsa import sparse_attention, indexer_scores, topk_indices, indexer_topk, explain
    from dsa import sparse_decode, sparse_decode_plan, quantize_kv_cache, dequantize_kv_cache   # serving

Backends: ``reference`` (plain PyTorch, any device), ``triton`` (every CUDA
GPU), ``cute`` (CuTe DSL kernels for Hopper/Blackwell where measured faster).
``backend="auto"`` chooses; ``explain(op, *args, **kwargs)`` says why.
"""

from dsa.api import explain, indexer_scores, indexer_topk, sparse_attention, topk_indices
from dsa.decode import SparseDecodePlan, sparse_decode, sparse_decode_plan
from dsa.kv_cache import dequantize_kv_cache, quantize_kv_cache
from dsa.training import attention_target, dense_attention_target, indexer_kl_loss, sparse_indexer_scores

__all__ = [
    "sparse_attention",
    "indexer_scores",
    "topk_indices",
    "indexer_topk",
    "explain",
    "attention_target",
    "sparse_indexer_scores",
    "indexer_kl_loss",
    "dense_attention_target",
    "sparse_decode",
    "sparse_decode_plan",
    "SparseDecodePlan",
    "quantize_kv_cache",
    "dequantize_kv_cache",
]

__version__ = "0.1.0"
