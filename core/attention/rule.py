"""The packing rule every attention path applies, and the score math they share.

Query token q sees key k iff both belong to the same sequence, k is in that sequence's shared prefix (item id
-1) or in q's own item, and pos(k) <= pos(q); in a layer with a sliding window W, also pos(q) - pos(k) < W.
Padding uses sequence ids that never match (-1 for queries, -2 for keys).
"""

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

QUERY_PAD_SEQ = -1
KEY_PAD_SEQ = -2
MASKED = -1e30  # a masked score: exp() of it minus any real score is 0 in float32
NT = (((1,), (1,)), ((), ()))  # dot_general's a @ b.T
NN = (((1,), (0,)), ((), ()))  # dot_general's a @ b


@dataclass(frozen=True)
class TokenMeta:
    """Per-token metadata of one side of the attention (queries or keys); int32 arrays [T]."""

    seq: np.ndarray
    item: np.ndarray
    pos: np.ndarray


def visible(q_seq, q_item, q_pos, k_seq, k_item, k_pos, window: int = 0):
    """The packing rule, broadcast over whatever shapes are given (jnp or np)."""
    rule = (q_seq == k_seq) & ((k_item < 0) | (k_item == q_item)) & (k_pos <= q_pos)
    return rule & (q_pos - k_pos < window) if window else rule


def softcapped(s, softcap: float | None):
    """Scaled scores after the soft-cap, if any (float32)."""
    return jnp.tanh(s / softcap) * softcap if softcap else s


def q_scale(scale: float | None, head_dim: int) -> float:
    """The factor on q.k: the layer's `scale`, or head_dim ** -0.5."""
    return scale if scale is not None else 1.0 / float(np.sqrt(head_dim))
