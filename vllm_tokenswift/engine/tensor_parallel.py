"""Tensor parallelism: the two collectives the proposer needs on vLLM's TP group. Every TP
rank runs the proposer on its own query/KV heads; view selection sums block importances over
the ranks (:func:`tp_all_gather`, ``core.kv_view.sum_over_ranks``) and the adaptive policy
decides from rank 0's cost model on every rank (:func:`tp_broadcast_from_rank0`), so all ranks
draft the same chains.
"""

from __future__ import annotations

import numpy as np
import torch


def tp_all_gather(t: torch.Tensor) -> torch.Tensor:
    """Gather a 1-D tensor from every tensor-parallel rank: ``[world, n]`` on the CPU,
    rows in rank order (vLLM's TP group, on the device its communicator uses)."""
    from vllm.distributed import get_tp_group

    group = get_tp_group()
    dev = getattr(group, "device", None) or t.device
    out = group.all_gather(t.to(dev).contiguous(), dim=0)
    return out.view(group.world_size, -1).cpu()


def tp_broadcast_from_rank0(vec: np.ndarray) -> np.ndarray:
    """Rank 0's float64 vector ``[n]`` on every tensor-parallel rank (an all-gather, row 0).

    vLLM's CPU communicator (``shm_all_gather``) has no float64 kernel, so the vector
    travels as float32 pairs ``hi = f32(x)``, ``lo = f32(x - hi)`` (about 48 bits of
    mantissa) and is rebuilt as ``hi + lo`` in float64. Every rank, rank 0 included,
    uses the rebuilt values, so all ranks hold the same numbers bit for bit.
    """
    x = np.asarray(vec, dtype=np.float64).reshape(-1)
    hi = x.astype(np.float32)
    lo = (x - hi.astype(np.float64)).astype(np.float32)
    g = tp_all_gather(torch.from_numpy(np.concatenate([hi, lo])))
    row = g[0].numpy()
    return row[: x.size].astype(np.float64) + row[x.size:].astype(np.float64)
