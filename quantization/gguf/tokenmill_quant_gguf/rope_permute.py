"""Undo llama.cpp's reordering of q/k projection rows.

llama.cpp's rope (for the ``llama`` arch) rotates *adjacent* pairs (x0, x1),
(x2, x3), ...; transformers' rotate-half pairs element i with i + head_dim/2.
So llama.cpp's converter reorders each head's rows from [first half, second
half] to interleaved [h0, s0, h1, s1, ...]. Putting them back lets the HF
rotate-half rope produce the same attention.
"""

from __future__ import annotations

import torch


def unpermute_rope_rows(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Rows of each head from interleaved pairs back to two contiguous halves.

    ``tensor`` is a q or k weight ``(num_heads * head_dim, in)`` or bias
    ``(num_heads * head_dim,)``; ``num_heads`` is the kv-head count for k.
    """
    rows = tensor.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"{rows} rows do not split into {num_heads} heads of even width")
    half = rows // num_heads // 2
    rest = tensor.shape[1:]
    # Stored row (head, i, s) holds HF row (head, s, i): swap the two inner axes back.
    return tensor.reshape(num_heads, half, 2, *rest).transpose(1, 2).reshape(tensor.shape)
