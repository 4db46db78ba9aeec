"""The ``torch.library`` custom ops behind the public API, one module per op family.

Each op takes the canonical argument dataclass of :mod:`dsa._args`
(flattened into its fields by :mod:`dsa.ops._core`) plus plain extras and the
requested backend name, and picks the implementation at run time through
:mod:`dsa.selector`. Fake (meta) implementations give ``torch.compile`` the
output shapes, so a compiled graph calls these ops without breaking. Empty
problems (each dataclass's ``empty``) are answered here, before any backend,
so that no kernel is ever launched on them.
"""

from dsa.ops._core import Op, call, direct_plain, flat
from dsa.ops.decode import sparse_decode
from dsa.ops.indexer import indexer_scores, indexer_scores_bwd, indexer_topk
from dsa.ops.sparse_attention import sparse_attention_bwd, sparse_attention_fwd
from dsa.ops.topk import topk
from dsa.ops.training import (
    attention_target,
    dense_attention_target,
    indexer_kl_bwd,
    indexer_kl_fwd,
    sparse_indexer_bwd,
    sparse_indexer_fwd,
)

__all__ = [
    "Op",
    "call",
    "direct_plain",
    "flat",
    "sparse_attention_fwd",
    "sparse_attention_bwd",
    "sparse_decode",
    "indexer_scores",
    "indexer_scores_bwd",
    "indexer_topk",
    "topk",
    "attention_target",
    "dense_attention_target",
    "sparse_indexer_fwd",
    "sparse_indexer_bwd",
    "indexer_kl_fwd",
    "indexer_kl_bwd",
]
