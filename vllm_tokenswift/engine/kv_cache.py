"""Reading keys out of vLLM's paged KV caches, whatever their layout: one reader per layout
the plugin knows, and the detection of which one a cache uses from a key the draft forward
just wrote (the budgeted view's block importance reads only the keys, in the cache's own
dtype; paper Sec 3.3).

Layouts: vLLM's CPU attention (``cpu_vec``: per (block, KV head), K transposed then V),
FlashAttention-style ``[num_blocks, H_kv, bs, 2D]`` with ``[K | V]`` in the last dim
(``split_last``), and the ``[2, num_blocks, ...]`` / ``[num_blocks, 2, ...]`` layouts of other
backends. A cache none of them reads leaves view selection to recency (logged once).

Torch only (no vLLM import): the caches are tensors.
"""

from __future__ import annotations

import torch


def keys_cpu_vec(kv: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Keys from vLLM's CPU attention cache (``vec`` ISA layout).

    The tensor's logical shape is ``[num_blocks, H_kv, bs, 2D]`` but each
    (block, head) chunk of ``2·bs·D`` elements holds K transposed ``[D, bs]``
    followed by V ``[bs, D]``.

    Returns ``[len(block_ids), H_kv, bs, D]`` (a transposed view of a copy of the K
    halves only; V is not read).
    """
    nb, h, bs, two_d = kv.shape
    d = two_d // 2
    k_half = kv.view(nb, h, 2, bs * d).select(2, 0)          # view: K^T of every (block, head)
    return k_half.index_select(0, block_ids).view(len(block_ids), h, d, bs).transpose(-1, -2)


def keys_split_last(kv: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Keys from a ``[num_blocks, H_kv, bs, 2D]`` cache whose last dim is ``[K | V]``
    (FlashAttention-style). Returns ``[len(block_ids), H_kv, bs, D]`` (K only is copied)."""
    d = kv.shape[-1] // 2
    return kv[..., :d].index_select(0, block_ids)


def keys_kv_first(kv: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Keys from a ``[2, num_blocks, bs, H_kv, D]`` cache. Returns ``[n, H_kv, bs, D]``."""
    return kv[0].index_select(0, block_ids).transpose(1, 2)


def keys_blocks_first(kv: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Keys from a ``[num_blocks, 2, bs, H_kv, D]`` cache. Returns ``[n, H_kv, bs, D]``."""
    return kv.select(1, 0).index_select(0, block_ids).transpose(1, 2)


KEY_READERS = {
    "cpu_vec": keys_cpu_vec,
    "split_last": keys_split_last,
    "kv_first": keys_kv_first,
    "blocks_first": keys_blocks_first,
}


def detect_key_layout(kv: torch.Tensor, slot: int, block_size: int, key: torch.Tensor) -> str | None:
    """Find which reader returns ``key`` at ``slot`` (probe with a freshly written key).

    Args:
        kv: one layer's cache tensor.
        slot: the slot the key was written to (``block_id * block_size + offset``).
        key: ``[H_kv, D]`` the key written there.
    Returns:
        the name of the matching reader in :data:`KEY_READERS`, or None.
    """
    b, off = divmod(int(slot), block_size)
    ids = torch.tensor([b], device=kv.device)
    for name, fn in KEY_READERS.items():
        try:
            k = fn(kv, ids)
        except Exception:  # shape does not fit this layout
            continue
        if k.dim() != 4 or k.shape[-2] != block_size or tuple(k.shape[1:2]) + tuple(k.shape[-1:]) != tuple(key.shape):
            continue
        got = k[0, :, off, :].float()
        if torch.allclose(got, key.float().to(got.device), rtol=2e-2, atol=2e-2):
            return name
    return None
