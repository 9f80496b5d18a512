"""The budgeted draft KV view (paper Sec 3.3), as a second paged view over a
request's own KV blocks.

The draft forward of the target model attends only to a view of the request's
KV cache made of whole blocks of vLLM's paged cache::

    [sink blocks] + [most important earlier blocks] + [recent blocks ... newest token's block]

* **Sink**: the first ``ceil(sink_tokens / block_size)`` blocks, always kept.
* **Important**: blocks ranked by the attention mass the newest token's query
  puts on them (Eq. 2 aggregated per block, see :func:`block_importance`).
* **Recent**: every block from the last re-selection point to the newest
  token's block, which is always last so that the view's last logical slot is
  the newest token's real slot (the draft forward writes its K/V there and
  verification overwrites it with exact values).

Dynamic updates follow Sec 3.3: the view always spans at most ``budget`` blocks;
as generation adds recent blocks, the least important selected blocks drop out
(the ranking is consumed from its tail); once the recent part would displace
every selected block, importance is recomputed and the view rebuilt. A context
shorter than the budget uses the whole context.

The view is *pointer-only*: block ids the request already owns, so drafting needs
no KV memory beyond vLLM's own cache and never modifies what verification reads
(apart from the newest token's own slot, which verification rewrites).

Granularity: a block table may differ per layer but not per KV head, so the
paper's per-head token selection becomes per-layer block selection
(``view_granularity="layer"``) or one selection shared by all layers
(``"shared"``, cheaper metadata). The benchmark measures what this costs in
acceptance against the ``full`` view.

This module is pure (numpy/torch): it reads vLLM's block table as a numpy array and is
given the importance scorer (``engine.target.TargetAccess.importance``, which reads the keys
out of vLLM's cache layouts with :mod:`vllm_tokenswift.engine.kv_cache`) and, under tensor
parallelism, the all-gather.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class RequestView:
    """Per-request view state.

    Attributes:
        recent_start: logical index of the first recent block (set at selection).
        ranking: per group (layer, or one shared group), middle block indices sorted
            by decreasing importance (only the first ``budget - sink - 1`` kept).
        selections: how many times the view was (re-)selected.
        pending_selection: the context outgrew the budget before a query was
            available; select at the next step.
    """

    recent_start: int = -1
    ranking: list[np.ndarray] | None = None
    selections: int = 0
    pending_selection: bool = False
    #: ``(last block, middle count) -> per-group block arrays`` of the latest plan: the
    #: view's blocks only change when the newest token enters a new block or the view is
    #: re-selected, so :meth:`ViewPlanner.plan` reuses them (no re-sort per step).
    cached: tuple | None = None


@dataclass
class ViewPlan:
    """What the draft forward of one request attends to.

    Attributes:
        blocks: per group, logical block indices (ascending, newest block last);
            a single entry means all groups share it.
        seq_len: logical length of the view in tokens (the newest token included).
        needs_query: the caller must select before drafting (``select`` then re-plan).
    """

    blocks: list[np.ndarray]
    seq_len: int
    full: bool = False
    needs_selection: bool = False


@dataclass
class ViewPlanner:
    """Plans block-level draft views for the ``dynamic``, ``static`` and ``full`` modes.

    Args:
        budget_tokens: ``kv_budget`` |B| in tokens (rounded down to whole blocks).
        sink_tokens: |S| (rounded up to whole blocks).
        block_size: vLLM KV block size in tokens.
        mode: ``"dynamic" | "static" | "full"``.
        num_groups: number of independent selections (layers, or 1 when shared).
    """

    budget_tokens: int
    sink_tokens: int
    block_size: int
    mode: str = "dynamic"
    num_groups: int = 1
    budget_blocks: int = field(init=False)
    sink_blocks: int = field(init=False)

    def __post_init__(self) -> None:
        self.budget_blocks = max(1, self.budget_tokens // self.block_size)
        self.sink_blocks = math.ceil(self.sink_tokens / self.block_size) if self.sink_tokens else 0
        if self.mode not in ("dynamic", "static", "full"):
            raise ValueError(f"unknown draft_kv mode {self.mode!r}")

    @property
    def max_view_blocks(self) -> int:
        """Upper bound on blocks in any view (for buffer sizing)."""
        return self.budget_blocks

    def plan(self, st: RequestView, pos: int) -> ViewPlan:
        """View for drafting the token after position ``pos`` (the newest token).

        Args:
            st: the request's view state (read, not modified).
            pos: 0-based position of the newest token (its K/V is written at ``pos``).
        """
        bs = self.block_size
        last = pos // bs
        seq_tail = pos % bs + 1
        n_ctx_blocks = last + 1
        if self.mode == "full" or n_ctx_blocks <= self.budget_blocks:
            return ViewPlan([np.arange(n_ctx_blocks, dtype=np.int64)], pos + 1, full=True)
        s = self.sink_blocks
        if st.ranking is None:
            # over budget but never selected: draft over the full context this once
            # (captures the query used for selection, like the paper's prefill selection)
            return ViewPlan([np.arange(n_ctx_blocks, dtype=np.int64)], pos + 1, full=True,
                            needs_selection=True)
        if self.mode == "static":
            middle_n = self.budget_blocks - s - 1
            recent = np.array([last], dtype=np.int64)
        else:
            n_recent = last - st.recent_start + 1
            middle_n = self.budget_blocks - s - n_recent
            if middle_n < 0:  # recent part displaced every selected block: re-select
                return ViewPlan([np.arange(n_ctx_blocks, dtype=np.int64)], pos + 1, full=True,
                                needs_selection=True)
            recent = np.arange(st.recent_start, last + 1, dtype=np.int64)
        key = (last, middle_n, st.selections)
        if st.cached is not None and st.cached[0] == key:
            views = st.cached[1]
        else:
            sink = np.arange(s, dtype=np.int64)
            views = [np.concatenate([sink, np.sort(rank[:middle_n]), recent]) for rank in st.ranking]
            st.cached = (key, views)
        seq_len = (len(views[0]) - 1) * bs + seq_tail
        return ViewPlan(views, seq_len)

    def select(self, st: RequestView, pos: int, importance: list[np.ndarray] | None) -> None:
        """(Re-)select the view from block importances computed at ``pos``.

        Args:
            st: state to update in place.
            pos: position of the newest token.
            importance: per group, a float array ``[last - sink_blocks]`` of scores for
                blocks ``sink_blocks .. last-1`` (higher = more important); ``None``
                falls back to recency (the most recent blocks rank highest).
        """
        last = pos // self.block_size
        s = self.sink_blocks
        keep = max(0, self.budget_blocks - s - 1)
        n_mid = max(0, last - s)
        if importance is None:
            order = [np.arange(last - 1, s - 1, -1, dtype=np.int64)[:keep]]
        else:
            order = []
            for imp in importance:
                if imp.shape[0] != n_mid:
                    raise ValueError(f"importance has {imp.shape[0]} blocks, expected {n_mid}")
                # stable: ties broken by recency (later block first)
                idx = np.argsort(-imp[::-1], kind="stable")[:keep]
                order.append((s + n_mid - 1 - idx).astype(np.int64))
        st.ranking = order
        st.recent_start = last
        st.selections += 1
        st.pending_selection = False


@dataclass
class DraftViews:
    """The budgeted views of a step's drafting requests over vLLM's block table: planning,
    (re-)selection from block importance, and the paged metadata of the draft forward.

    vLLM keeps one block table row per batch row (``input_batch.block_table[0]``,
    ``[max_num_reqs, max_blocks_per_req]`` int32 physical block ids); a view is a list
    of that row's *logical* block indices (:class:`ViewPlan`), so the draft forward's
    block table is the row gathered at those indices (:meth:`block_tables`), one table
    per group (layer) when views differ per layer.

    Args:
        planner: the engine's :class:`ViewPlanner`.
        importance: ``f(blocks: int64[n] physical ids, query_row, num_groups) ->
            list[float array [n]]`` (per group; ``draft_forward.TargetAccess.importance``),
            scored with row ``query_row`` of the latest draft forward's captured queries.
        all_gather: tensor parallelism: the TP all-gather for :func:`sum_over_ranks`
            (None with one rank).
        stats: counters ``views_full``, ``views_budgeted``, ``view_selections`` are
            incremented on it (``metrics.TokenSwiftStats``).
    """

    planner: ViewPlanner
    importance: object
    all_gather: object = None
    stats: object = None

    def plan(self, block_table: np.ndarray, batch_rows: list[int], views: list[RequestView],
             positions: list[int], query_rows: list[int]) -> list[ViewPlan]:
        """Plan every drafting request's view, (re-)selecting those that need it and still
        hold their own query from the latest draft forward (``query_rows[k] >= 0``: its row
        there; -1: gone). A request that needs a selection without a query drafts over
        its whole context this time and selects right after
        (:meth:`select_after_forward`).

        Args:
            block_table: ``[rows, max_blocks]`` int32, vLLM's block table (numpy view).
            batch_rows, views, positions, query_rows: per drafting request, its batch row,
                view state, newest token's position and query row.
        Returns:
            per request, its :class:`ViewPlan`.
        """
        planner = self.planner
        plans = [planner.plan(v, p) for v, p in zip(views, positions)]
        ready = [k for k, plan in enumerate(plans) if plan.needs_selection and query_rows[k] >= 0]
        self._select(block_table, batch_rows, views, positions, ready, [query_rows[k] for k in ready])
        for k in ready:
            plans[k] = planner.plan(views[k], positions[k])
        if self.stats is not None:
            for plan in plans:
                if plan.full:
                    self.stats.views_full += 1
                else:
                    self.stats.views_budgeted += 1
        return plans

    def select_after_forward(self, block_table, batch_rows, views, positions, plans) -> None:
        """(Re-)select the views of the requests that drafted over their whole context
        because they needed a selection, from the queries the draft forward just captured
        (row k of the forward is request k): the next draft forward of each reads its
        budgeted view, whatever other requests drafted in between."""
        late = [k for k, plan in enumerate(plans) if plan.needs_selection]
        if late:
            self._select(block_table, batch_rows, views, positions, late, late)

    def _select(self, block_table, batch_rows, views, positions, which, query_rows) -> None:
        """Select the views of requests ``which`` from block importances (paper Sec 3.3,
        Eq. 2 per block) scored with query row ``query_rows[j]``.

        Under tensor parallelism the importances are summed over the TP ranks in one
        collective before the top-k (:func:`sum_over_ranks`), so all ranks select the
        same blocks, the ones single-rank TokenSwift would select. Which requests select
        depends only on positions and step counters, identical on all ranks, so every
        rank reaches the collective (none when nothing selects, none with one rank)."""
        if not which:
            return
        planner = self.planner
        s = planner.sink_blocks
        imps = []
        for k, q_row in zip(which, query_rows):
            last = positions[k] // planner.block_size
            blocks = block_table[batch_rows[k], s:last] if last > s else np.zeros(0, np.int64)
            imps.append(self.importance(blocks, q_row, planner.num_groups))
        if self.all_gather is not None:
            imps = sum_over_ranks(imps, self.all_gather)
        for k, imp in zip(which, imps):
            planner.select(views[k], positions[k], imp)
            if self.stats is not None:
                self.stats.view_selections += 1

    @staticmethod
    def block_tables(block_table: np.ndarray, batch_rows: list[int], plans: list[ViewPlan]) -> list[np.ndarray]:
        """The draft forward's block tables: per group, ``[n, width]`` int32 physical block
        ids (row k: request k's view, zero-padded to the widest view of the group)."""
        n_groups = max(len(pl.blocks) for pl in plans)
        tables = []
        for g in range(n_groups):
            width = max(len(pl.blocks[g if len(pl.blocks) > 1 else 0]) for pl in plans)
            tab = np.zeros((len(plans), width), dtype=np.int32)
            for k, (row, pl) in enumerate(zip(batch_rows, plans)):
                b = pl.blocks[g if len(pl.blocks) > 1 else 0]
                tab[k, : len(b)] = block_table[row, b]
            tables.append(tab)
        return tables

    def slots(self, block_table: np.ndarray, batch_rows: list[int], positions: list[int]) -> list[int]:
        """The slot mapping of the newest tokens: ``block_id * block_size + offset`` of
        position ``positions[k]`` in batch row ``batch_rows[k]`` (their real slots)."""
        bs = self.planner.block_size
        return [int(block_table[row, p // bs]) * bs + p % bs for row, p in zip(batch_rows, positions)]


def block_importance(q: torch.Tensor, keys: torch.Tensor, num_valid_tokens: int | None = None) -> torch.Tensor:
    """Attention mass the newest token's query puts on each KV block (Eq. 2, per block).

    For each KV head ``h`` the group's query heads are summed first
    (``Σ_j q_j · k = (Σ_j q_j) · k``, so K is never repeated for GQA), softmax-
    normalised over the candidate tokens, and the per-block mass summed over heads.

    Args:
        q: ``[H_q, D]`` query of the newest token (after RoPE), any float dtype.
        keys: ``[N_blocks, H_kv, bs, D]`` keys of the candidate blocks.
        num_valid_tokens: tokens of the candidates that are real (default all).
    Returns:
        ``[N_blocks]`` float32 scores; they sum to ``H_kv``.
    Raises:
        ValueError: if ``H_q`` is not a multiple of ``H_kv``.
    """
    nb, hkv, bs, d = keys.shape
    hq = q.shape[0]
    if hq % hkv:
        raise ValueError(f"{hq} query heads do not group over {hkv} KV heads")
    qg = q.float().view(hkv, hq // hkv, d).sum(1).to(keys.dtype)  # [H_kv, D], the cache's dtype
    scores = torch.einsum("hd,nhbd->hnb", qg, keys).float().reshape(hkv, nb * bs) / math.sqrt(d)
    if num_valid_tokens is not None and num_valid_tokens < nb * bs:
        scores[:, num_valid_tokens:] = float("-inf")
    probs = torch.softmax(scores, dim=-1)
    return probs.view(hkv, nb, bs).sum(dim=(0, 2))


def sum_over_ranks(importances: list[list[np.ndarray] | None],
                   all_gather) -> list[list[np.ndarray] | None]:
    """Sum block importances over tensor-parallel ranks, so every rank selects the same view.

    Under tensor parallelism each rank holds only its own query and KV heads, so
    :func:`block_importance` on one rank covers its heads only and ranks would rank
    blocks differently. Summing the per-rank scores gives the importance over all
    heads: :func:`block_importance` is a sum over KV heads, so the sum over ranks
    equals the single-process score (up to float rounding) whenever each KV head
    lives on one rank.

    Every rank gathers all ranks' scores (one collective for the whole batch) and
    adds them in rank order itself, so the sums are bitwise identical on all ranks
    whatever the all-reduce's arithmetic; ties and near-ties break the same way.

    Args:
        importances: per request, per group float arrays (as returned to
            :meth:`ViewPlanner.select`), or None (recency fallback). Every rank must
            pass the same structure and array sizes (they depend on positions only).
        all_gather: ``f(t: Tensor[n]) -> Tensor[world, n]`` over the TP group, or None
            (single rank: returned unchanged).
    Returns:
        the same structure with summed float64 scores.
    Raises:
        ValueError: the gather did not return ``[world, n]``.
    """
    flat = [a for imp in importances if imp is not None for a in imp]
    total = sum(int(a.shape[0]) for a in flat)
    if all_gather is None or total == 0:
        return importances
    local = torch.from_numpy(np.concatenate([np.asarray(a, dtype=np.float32) for a in flat]))
    gathered = all_gather(local)
    if gathered.dim() != 2 or gathered.shape[1] != total:
        raise ValueError(f"all_gather returned shape {tuple(gathered.shape)}, expected [world, {total}]")
    g = gathered.detach().to("cpu", torch.float64).numpy()
    summed = g[0].copy()
    for r in range(1, g.shape[0]):  # fixed order: identical bits on every rank
        summed += g[r]
    out: list[list[np.ndarray] | None] = []
    off = 0
    for imp in importances:
        if imp is None:
            out.append(None)
            continue
        parts = []
        for a in imp:
            n = int(a.shape[0])
            parts.append(summed[off: off + n])
            off += n
        out.append(parts)
    return out
