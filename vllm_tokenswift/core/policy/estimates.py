"""The drafting policy's running estimates, measured while the engine runs: what a step
costs (:class:`CostModel`), how often each option's drafts are accepted per position
(:class:`AcceptanceModel`), and each chain token's acceptance by source, position and
confidence (:class:`Calibration`). :mod:`vllm_tokenswift.core.policy.decision` decides from them; the
formulas and the decision they feed are described there.

Engine-free: numpy only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from vllm_tokenswift.core.config import DRAFT_TOKEN_COST_PRIOR
# the options the policy chooses from per request and step
from vllm_tokenswift.core.step import CHAIN, DRAFT_KINDS, FORWARD, FUSED, KINDS, NGRAM, NONE  # noqa: F401


# ============================================================== cost model
@dataclass
class _RidgeFit:
    """``y ≈ X·c`` with ``c >= 0`` by ridge least squares over the last ``window``
    observations, pulled towards a prior ``p`` by ``Σ_i strength·scale_i²·(c_i - p_i)²``.

    Non-negativity (costs never fall with more work) by a small active set: a
    coefficient that comes out negative is fixed at 0 and the rest refitted.

    Args:
        features: number of features (columns of ``X``).
        window: observations kept.
        strength: weight of the prior (pseudo-observations at ``scale_i``).
    """

    features: int
    window: int = 64
    strength: float = 2.0
    rows: deque = field(default_factory=deque)
    # running sums of the window's normal equations (X'X, X'y), rebuilt exactly from the
    # rows every ``window`` additions so that rounding never accumulates
    _xtx: list = field(default=None, init=False, repr=False)
    _xty: list = field(default=None, init=False, repr=False)
    _adds: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        self._rebuild()

    def _rebuild(self) -> None:
        f = self.features
        self._xtx = [[0.0] * f for _ in range(f)]
        self._xty = [0.0] * f
        for x, y in self.rows:
            self._accumulate(x, y, 1.0)

    def _accumulate(self, x: tuple, y: float, sign: float) -> None:
        xtx, xty = self._xtx, self._xty
        for i, xi in enumerate(x):
            if xi:
                xty[i] += sign * xi * y
                row = xtx[i]
                for j, xj in enumerate(x):
                    row[j] += sign * xi * xj

    def add(self, x: Sequence[float], y: float) -> None:
        """One observation: feature vector ``x`` (length ``features``), target ``y``.
        O(features²): the normal equations are kept as running sums over the window."""
        row = (tuple(float(v) for v in x), float(y))
        self.rows.append(row)
        self._accumulate(row[0], row[1], 1.0)
        while len(self.rows) > self.window:
            old = self.rows.popleft()
            self._accumulate(old[0], old[1], -1.0)
        self._adds += 1
        if self._adds % self.window == 0:
            self._rebuild()

    def __len__(self) -> int:
        return len(self.rows)

    def solve(self, prior: Sequence[float], scale: Sequence[float]) -> list[float]:
        """Ridge solution ``c`` (length ``features``, all ``>= 0``); ``scale_i`` is a
        typical value of feature i, so every prior weighs like ``strength`` observations.

        Solves ``(X'X + diag(λ)) c = X'y + λ·p`` (``λ_i = strength·scale_i²``) on the
        coefficients still free, fixing any that come out negative at 0 (at most
        ``features`` rounds). Plain Python on the kept sums: the systems are 2×2 or 3×3
        and this runs every engine step, where numpy's per-call overhead dominated."""
        f = self.features
        if not self.rows:
            return [max(0.0, float(v)) for v in prior]
        lam = [self.strength * float(v) ** 2 for v in scale]
        A = [[self._xtx[i][j] + (lam[i] if i == j else 0.0) for j in range(f)] for i in range(f)]
        rhs = [self._xty[i] + lam[i] * float(prior[i]) for i in range(f)]
        free = list(range(f))
        c = [0.0] * f
        for _ in range(f):
            sol = _solve_small([[A[i][j] for j in free] for i in free], [rhs[i] for i in free])
            c = [0.0] * f
            for i, v in zip(free, sol):
                c[i] = v
            neg = [i for i in free if c[i] < 0]
            if not neg:
                break
            free = [i for i in free if c[i] >= 0]
            if not free:
                c = [0.0] * f
                break
        return [max(0.0, v) for v in c]


def _solve_small(A: list, b: list) -> list:
    """``A x = b`` for a small dense system (Gaussian elimination, partial pivoting).

    Raises:
        numpy.linalg.LinAlgError: ``A`` is singular (as ``numpy.linalg.solve``)."""
    n = len(b)
    M = [list(map(float, row)) + [float(v)] for row, v in zip(A, b)]
    for k in range(n):
        p = max(range(k, n), key=lambda r: abs(M[r][k]))
        if M[p][k] == 0.0:
            raise np.linalg.LinAlgError("singular matrix")
        M[k], M[p] = M[p], M[k]
        piv = M[k][k]
        for r in range(k + 1, n):
            fac = M[r][k] / piv
            if fac:
                Mr, Mk = M[r], M[k]
                for j in range(k, n + 1):
                    Mr[j] -= fac * Mk[j]
    x = [0.0] * n
    for k in range(n - 1, -1, -1):
        x[k] = (M[k][n] - sum(M[k][j] * x[j] for j in range(k + 1, n))) / M[k][k]
    return x


@dataclass
class CostModel:
    """Online step-cost model (see module doc). All times in seconds.

    The step fit is ``a + g·[D>0] + b1·F + b·(D - F)`` over ``(1, [D>0], F, D - F)``, ``D``
    the step's verified draft tokens and ``F`` the requests that verified any: a request's
    first draft token is priced apart from its later ones (``b1`` against ``b``). One
    price per draft token could not say what a long context does to verification on the
    CPU: the attention of a request verifying ``q`` query tokens is bound by reading its
    KV cache for ``q`` up to 2-3 and by arithmetic beyond, so at a 96K-token context (demo
    model, the paper's sampling) verifying one draft cost no more than a plain step
    (81.5 against 86.2 ms) while n-gram chains of 4-8 drafts cost about 9 ms per draft
    token; fitted as one ``b`` = 8.9 ms, a one-token self-speculative chain was priced at
    1.04x plain decoding's throughput, under the 5% margin, where ``triforce-1`` (one every
    step) measured 1.21x (docs/bench/long, "At a 96K-token context"). With one request per
    step ``[D>0]`` and ``F`` are the same column: ``g + b1`` is what the data fix, split by
    the priors.

    Priors, as fractions of the draft-free step time ``a`` and of its per-request share
    ``a/R`` (``R``: requests in the step, averaged over the observations): a step that
    verifies any draft pays ``prior_g``·a once (the rejection sampler, the spec-decode
    metadata and the wider logits), each verified draft token ``prior_b``·a, the first of
    a request's as the later ones (not ``a/R``:
    at batch 8 under the paper's sampling, where 98% of the steps are plain and the fit
    sees few drafting steps, ``0.08·a/8`` let through steps verifying 11-12 draft tokens,
    mostly n-gram tokens accepted about once per chain, that cost 7-10 ms per draft token
    on the CPU, 84-124 ms over a 205 ms plain step; see
    ``PolicyTuning.draft_token_cost_prior`` and ``step-trace/b8-paper-tuning-ab.txt``), the
    draft forward ``prior_forward``·a (it reads all the weights, like a decode step, but
    attends to the budgeted view only) plus ``prior_forward_row``·a/R per row, the fused
    heads ``prior_fused``·a (three ``H×H`` products and one LM-head product for three
    rows) plus ``prior_fused_row``·a/R.

    Args:
        window: observations kept per fit.
        strength: weight of the priors of the forward/fused fits (pseudo-observations).
            Half an observation: the priors (``prior_forward``·a: a draft forward costs
            most of a plain step, as at short context where the weights dominate) are
            wrong by 3-4x at long context (a 1,024-token view against a 32K context: a
            draft forward cost 0.14-0.3 of a plain step, docs/bench/long), and a request
            tries the forward only every 48 steps or less often; with a weight of 2 three
            tries left the estimate at 0.6·a and the policy took the draft forward on 0% of
            the steps of a 1,024-token request at 32K (2026-12-03). A draft forward's
            time is measured directly, so one try may outweigh the prior.
        step_strength: weight of the priors of the step fit (weaker: every step
            observes it, and its split between ``a``, ``g`` and ``b`` is what decides).
        refresh_every: once ``2·refresh_every`` steps were observed, the estimates are
            solved again only after this many new step observations (or any draft
            forward / fused observation); in between :meth:`costs` returns the last
            solution. One observation moves a fit over ``window`` of them by little,
            and the three solves were 18% of the proposer's own time per step at
            batch 1 (cProfile, tiny model, the paper's sampling) (1: solve after every
            observation).
    """

    window: int = 64
    strength: float = 0.5
    step_strength: float = 0.25
    prior_g: float = 0.15
    prior_b: float = DRAFT_TOKEN_COST_PRIOR
    prior_forward: float = 0.8
    prior_forward_row: float = 0.3
    prior_fused: float = 0.15
    prior_fused_row: float = 0.05
    refresh_every: int = 1
    #: order of :meth:`state`
    KEYS = ("a", "g", "b", "f0", "f1", "h0", "h1", "c0", "c1", "b1")
    _step: _RidgeFit = field(init=False)
    _fwd: _RidgeFit = field(init=False)
    _fus: _RidgeFit = field(init=False)
    _chn: _RidgeFit = field(init=False)
    _rows: deque = field(default_factory=deque, init=False)
    _plain: int = field(default=0, init=False)
    _frozen: dict | None = field(default=None, init=False)
    _cached: dict | None = field(default=None, init=False)
    _steps_seen: int = field(default=0, init=False)
    _stale_steps: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.refresh_every < 1:
            raise ValueError(f"refresh_every must be >= 1, got {self.refresh_every}")
        self._step = _RidgeFit(4, self.window, self.step_strength)
        self._fwd = _RidgeFit(2, self.window, self.strength)
        self._fus = _RidgeFit(2, self.window, self.strength)
        self._chn = _RidgeFit(2, self.window, self.strength)

    # ---------------------------------------------------------------- observations
    def observe_step(self, seconds: float, rows: int, draft_tokens: int,
                     drafting_rows: int | None = None) -> None:
        """One engine step outside the proposer's forward/fused work: ``seconds`` for
        ``rows`` requests verifying ``draft_tokens`` draft tokens in total, ``drafting_rows``
        of them at least one (None: ``min(rows, draft_tokens)``, exact for one request).

        Raises:
            ValueError: ``drafting_rows`` is more than ``rows`` or than ``draft_tokens``,
                or is 0 while ``draft_tokens`` is not (or the reverse).
        """
        if seconds <= 0 or rows <= 0:
            return
        if drafting_rows is None:
            drafting_rows = min(rows, max(0, draft_tokens))
        if drafting_rows > min(rows, draft_tokens) or (drafting_rows > 0) != (draft_tokens > 0):
            raise ValueError(f"{drafting_rows} drafting rows for {rows} rows and {draft_tokens} draft tokens")
        if len(self._step) == self.window and self._step.rows[0][0][1] == 0.0:
            self._plain -= 1          # a plain observation leaves the window
        self._step.add(self._step_features(draft_tokens, drafting_rows), seconds)
        self._plain += draft_tokens <= 0
        self._rows.append(rows)
        while len(self._rows) > self.window:
            self._rows.popleft()
        self._steps_seen += 1
        self._stale_steps += 1
        if self._stale_steps >= self.refresh_every or self._steps_seen <= 2 * self.refresh_every:
            self._cached = None

    @staticmethod
    def _step_features(draft_tokens: int, drafting_rows: int) -> tuple:
        """The step fit's row ``(1, [D>0], F, D - F)`` for ``a, g, b1, b``."""
        return (1.0, 1.0 if draft_tokens > 0 else 0.0, drafting_rows, draft_tokens - drafting_rows)

    def observe_forward(self, seconds: float, rows: int) -> None:
        """One draft forward over ``rows`` requests (view planning included)."""
        if seconds > 0 and rows > 0:
            self._fwd.add((1.0, rows), seconds)
            self._cached = None

    def observe_chain(self, seconds: float, rows: int) -> None:
        """One forward of self-speculative chains over ``rows`` requests (view planning
        included for the first). Fitted apart from :meth:`observe_forward`: a chain forward
        computes one logits row per request and no heads, where the draft forward runs
        the heads and the LM head over ``1 + num_heads`` rows per request. One fit for
        both priced chains at the draft forward's cost (demo model, 32K context, the
        paper's sampling: 7.3 ms per forward against the 20 ms plain step, so a one-token
        chain, 1.6 tokens per step, looked break-even and was rarely taken, while the
        ``triforce-1`` baseline, a one-token chain every step, ran 1.23x the kernel alone)."""
        if seconds > 0 and rows > 0:
            self._chn.add((1.0, rows), seconds)
            self._cached = None

    def observe_fused(self, seconds: float, rows: int) -> None:
        """Fused heads (+ LM head) for ``rows`` requests."""
        if seconds > 0 and rows > 0:
            self._fus.add((1.0, rows), seconds)
            self._cached = None

    def plain_observations(self) -> int:
        """Steps in the window that verified no draft token (they pin down ``a`` apart
        from ``g``; see :func:`needs_plain_probe`)."""
        return self._plain

    # ---------------------------------------------------------------- estimates
    @property
    def ready(self) -> bool:
        """At least one step was observed (before that, :meth:`costs` is a guess)."""
        return self._frozen is not None or len(self._step) > 0

    def costs(self) -> dict:
        """``{"a", "g", "b", "f0", "f1", "h0", "h1", "c0", "c1", "b1"}`` in seconds (rank
        0's numbers once :meth:`load_state` was called); ``b1``: a request's first draft
        token, ``b``: each later one."""
        if self._frozen is not None:
            return dict(self._frozen)
        return self._estimate()

    def _estimate(self) -> dict:
        """This rank's own estimates from its observations (never the frozen ones),
        solved again when :attr:`refresh_every` says so (a copy: callers may change it)."""
        if self._cached is None:
            self._cached = self._solve()
            self._stale_steps = 0
        return dict(self._cached)

    def _a_prior(self) -> float:
        """The plain step time the priors are fractions of: the median of the window's
        draft-free step observations (of all of them while there is none; 1.0 before any).

        The median, not the first observation: the first decode step after a long prefill
        is an outlier (244 ms against 17 ms for the next ones at a 16K-token context on the
        demo model), and priors scaled by it put ``b``, which the step fit holds near its
        prior (its scale is ``4·rows``) while few drafting steps are in the window, at 16 ms
        per draft token where the steps measured 3 (16K), 48 where they measured ~11 (64K),
        so the policy priced chains and heads out at long context."""
        ys = [y for x, y in self._step.rows if x[1] == 0.0] or [y for _x, y in self._step.rows]
        return float(np.median(ys)) if ys else 1.0

    def _solve(self) -> dict:
        a_prior = self._a_prior()
        rows = sum(self._rows) / len(self._rows) if self._rows else 1.0
        a, g, b1, b = self._step.solve((a_prior, self.prior_g * a_prior, self.prior_b * a_prior,
                                        self.prior_b * a_prior), (1.0, 1.0, rows, 4.0 * rows))
        a = max(a, 1e-6)
        b = max(b, 1e-4 * a / rows)
        b1 = max(b1, 1e-4 * a / rows)
        per_row = a / rows
        f0, f1 = self._fwd.solve((self.prior_forward * a, self.prior_forward_row * per_row), (1.0, rows))
        h0, h1 = self._fus.solve((self.prior_fused * a, self.prior_fused_row * per_row), (1.0, rows))
        # a chain forward's prior is the draft forward's estimate (at most its cost: the same
        # forward without the heads), replaced by the chains' own measurements
        c0, c1 = self._chn.solve((f0, f1), (1.0, rows))
        return {"a": a, "g": g, "b": b, "f0": f0, "f1": f1, "h0": h0, "h1": h1, "c0": c0, "c1": c1, "b1": b1}

    # ---------------------------------------------------------------- TP sync
    def state(self) -> np.ndarray:
        """The current estimates as a float64 vector in :attr:`KEYS` order (rank 0
        broadcasts it). Always this rank's own observations, solved from all of them
        (whatever :attr:`refresh_every`), also after :meth:`load_state` froze what
        :meth:`costs` returns, so rank 0 keeps broadcasting fresh numbers."""
        c = self._solve()
        return np.array([c[k] for k in self.KEYS], dtype=np.float64)

    def load_state(self, vec: Sequence[float]) -> None:
        """Decide from these estimates (another rank's :meth:`state`) until the next call.

        Raises:
            ValueError: ``vec`` does not have one value per key of :attr:`KEYS`.
        """
        vals = [float(v) for v in vec]
        if len(vals) != len(self.KEYS):
            raise ValueError(f"cost state has {len(vals)} values, expected {len(self.KEYS)} "
                             f"({', '.join(self.KEYS)})")
        self._frozen = dict(zip(self.KEYS, vals))


# ============================================================== acceptance
@dataclass
class DepthCounts:
    """Decayed ``reached``/``accepted`` counts per draft position (one option)."""

    depth: int
    decay: float = 0.995
    reached: np.ndarray = field(init=False)
    accepted: np.ndarray = field(init=False)
    #: bumped by every :meth:`update` that changes the counts (keys the estimate caches)
    version: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.reached = np.zeros(self.depth)
        self.accepted = np.zeros(self.depth)

    def update(self, num_verified: int, num_accepted: int, span: int = 0) -> None:
        """A chain of ``num_verified`` drafts had its first ``num_accepted`` accepted.

        ``span``: the positions the option could have drafted (its planned length). A
        chain cut shorter than that (by the policy's own cut) and wholly accepted counts
        its first missing position as reached and not accepted: the option's estimate is
        then what taking it realises, cut included (a draft forward whose head tokens are
        always cut yields its l_0 token only, however good the heads' prior says they
        are; before, those never-verified positions kept their prior of 0.6 and the draft
        forward looked worth 2.6 tokens while it realised 0.9)."""
        if num_verified <= 0 and span <= 0:
            return
        self.version += 1
        self.reached *= self.decay
        self.accepted *= self.decay
        n = min(max(num_verified, span), self.depth)
        a = max(0, min(num_accepted, num_verified))
        reach = min(n, a + 1)             # positions 0..a were examined (a rejected, if any)
        self.reached[:reach] += 1.0
        self.accepted[: min(a, n)] += 1.0

    def update_first(self, accepted: bool) -> None:
        """Position 0 alone was observed (``accepted`` or not): it is decayed and counted;
        the later positions, which this observation says nothing about, are left as they are."""
        self.version += 1
        self.reached[0] = self.reached[0] * self.decay + 1.0
        self.accepted[0] = self.accepted[0] * self.decay + (1.0 if accepted else 0.0)


#: options whose first draft token is the same draw: under sampling, the draft forward's
#: position 0 and a self-speculative chain's first token are both drawn from l_0 of one
#: forward over the request's budgeted view, with the same processors, so each one's
#: verified first token is an observation of the other's (greedy chains of the draft
#: forward may start with an n-gram token instead, so greedy requests keep them apart)
SHARED_FIRST = {FORWARD: CHAIN, CHAIN: FORWARD}


def shrunk(acc: np.ndarray, reach: np.ndarray, prior: np.ndarray, weight: float) -> np.ndarray:
    """``(accepted + w·prior) / (reached + w)`` elementwise (Beta-style shrinkage)."""
    return (acc + weight * prior) / (reach + weight)


@dataclass
class AcceptanceModel:
    """Per-option, per-position conditional acceptance: engine-wide and per request.

    The engine-wide figures are kept apart per request *group* (the proposer uses
    ``"greedy"`` and ``"sampled"``): a greedy request accepts an option's drafts far
    more often than a sampled one, so one engine-wide figure learnt on greedy traffic
    would tell a sampled request that drafting pays (seen in the demo: one engine,
    a greedy run then a sampled one, draft forward on half the sampled steps).

    In the groups of ``shared_first_groups`` (the proposer's ``"sampled"``) a verified
    first token of the draft forward or of a self-speculative chain is booked for both
    (:data:`SHARED_FIRST`): estimated apart, the same probability drifted apart by noise
    and the policy took the draft forward for a one-token draft (its heads cut) where
    the chain draws the same token for less (demo model, 32K context, the paper's
    sampling: 32 such steps against 213 one-token chains in 600 tokens).

    Args:
        depth: positions tracked (``num_speculative_tokens``).
        prior_weight: pseudo-observations of the engine-wide figure in a request's
            estimate (and of the initial prior in the engine-wide one).
        initial: option -> prior conditional acceptance per position before anything
            was measured (optimistic enough that every option gets tried).
        shared_first_groups: the groups whose first tokens are shared as above.
    """

    depth: int
    prior_weight: float = 8.0
    initial: dict = field(default_factory=lambda: {FORWARD: 0.6, CHAIN: 0.6, FUSED: 0.4, NGRAM: 0.5})
    shared_first_groups: tuple = ("sampled",)
    engine: dict = field(init=False)      # group -> option -> DepthCounts

    def __post_init__(self) -> None:
        self.engine = {}

    def _group(self, group: str) -> dict:
        g = self.engine.get(group)
        if g is None:
            g = self.engine[group] = {k: DepthCounts(self.depth) for k in DRAFT_KINDS}
        return g

    def new_request(self, group: str = "all") -> dict:
        """Fresh per-request counts (keep them in the request's state); ``group`` names
        the engine-wide figures this request learns from and contributes to. The dict
        maps every option of :data:`DRAFT_KINDS` to its :class:`DepthCounts`, ``"group"``
        to the group, and ``"_cum"`` to :meth:`cumulative`'s cache once asked."""
        req: dict = {k: DepthCounts(self.depth, decay=0.98) for k in DRAFT_KINDS}
        req["group"] = group
        return req

    def record(self, req: dict, kind: str, num_verified: int, num_accepted: int,
               span: int = 0) -> None:
        """Book one verification of ``kind``'s chain: ``num_verified`` drafts, of which
        the first ``num_accepted`` were accepted; ``span``: the option's planned length
        (see :meth:`DepthCounts.update`; 0: only the verified positions count)."""
        eng = self._group(req["group"])
        if kind not in eng:
            return
        eng[kind].update(num_verified, num_accepted, span)
        req[kind].update(num_verified, num_accepted, span)
        other = SHARED_FIRST.get(kind)
        if other is not None and num_verified > 0 and req["group"] in self.shared_first_groups:
            eng[other].update_first(num_accepted > 0)
            req[other].update_first(num_accepted > 0)

    def engine_probs(self, kind: str, group: str = "all") -> np.ndarray:
        """Engine-wide conditional acceptance per position of ``kind`` in ``group``."""
        e = self._group(group)[kind]
        prior = np.full(self.depth, self.initial[kind])
        return shrunk(e.accepted, e.reached, prior, self.prior_weight)

    def probs(self, req: dict, kind: str) -> np.ndarray:
        """Conditional acceptance per position for this request and option."""
        r = req[kind]
        return shrunk(r.accepted, r.reached, self.engine_probs(kind, req["group"]), self.prior_weight)

    def cumulative(self, req: dict, kind: str, length: int) -> np.ndarray:
        """``cum_j`` = P(first j+1 drafts accepted), ``j < length`` (float64, read-only).

        Cached in ``req`` and computed again only when the request's or its group's
        counts of ``kind`` changed (:attr:`DepthCounts.version`): most steps book no
        verification of most options, and the proposer asks every step."""
        own, eng = req[kind], self._group(req["group"])[kind]
        key = (own.version, eng.version, length)
        cache = req.setdefault("_cum", {})
        hit = cache.get(kind)
        if hit is not None and hit[0] is own and hit[1] is eng and hit[2] == key:
            return hit[3]
        cum = np.cumprod(self.probs(req, kind)[:length])
        cum.setflags(write=False)
        cache[kind] = (own, eng, key, cum)
        return cum


@dataclass
class Calibration:
    """Acceptance of one draft token by (source, position bucket, confidence bin),
    engine-wide, decayed: turns the chain selector's own confidence (its q_i
    estimate) into a measured probability.

    Args:
        num_bins: confidence bins over [0, 1].
        positions: position buckets (positions beyond the last share it).
        prior_weight: pseudo-observations of the bin's centre as the prior.
    """

    num_bins: int = 10
    positions: int = 8
    prior_weight: float = 4.0
    decay: float = 0.999
    reached: dict = field(default_factory=dict)
    accepted: dict = field(default_factory=dict)

    def _key(self, source: int, pos: int, conf: float) -> tuple:
        b = min(self.num_bins - 1, max(0, int(conf * self.num_bins)))
        return source, min(pos, self.positions - 1), b

    def prob(self, source: int, pos: int, conf: float) -> float:
        k = self._key(source, pos, conf)
        centre = (k[2] + 0.5) / self.num_bins
        r = self.reached.get(k, 0.0)
        a = self.accepted.get(k, 0.0)
        return (a + self.prior_weight * centre) / (r + self.prior_weight)

    def chain_cum(self, sources: Sequence[int], confs: Sequence[float],
                  priors: Sequence[float | None] | None = None) -> np.ndarray:
        """``cum_j``: the product of :meth:`prob` over the chain's first ``j+1`` tokens
        (``sources``: calibration source keys; ``confs``: the chain selector's
        confidences), float64, length ``min(len(sources), len(confs))``.

        ``priors``: per token, the prior acceptance to shrink its bin towards instead of
        the bin's centre, or None to keep the centre. The centre is right where the
        confidence is the token's own probability of being accepted (a greedy draft, an
        n-gram token); a token *drawn* from a draft distribution q is accepted with
        ``min(1, p/q)``, on average ``Σ min(p, q)``, which q's largest probability (its
        confidence) does not tell: the target's own chain tokens over a 1,024-token view
        of a 4K context were accepted 93-100% in every confidence bin from 0.0-0.1 to
        0.5-0.6 (demo model, the paper's sampling). With the centre as prior such tokens
        were cut before they were ever verified, so their bins never learnt."""
        reached, accepted, w, nb = self.reached, self.accepted, self.prior_weight, self.num_bins
        last = self.positions - 1
        out = []
        cum = 1.0
        for j, (s, c) in enumerate(zip(sources, confs)):   # prob() inlined: one dict key per token
            b = min(nb - 1, max(0, int(c * nb)))
            k = (s, j if j < last else last, b)
            pr = priors[j] if priors is not None and j < len(priors) and priors[j] is not None else (b + 0.5) / nb
            cum *= (accepted.get(k, 0.0) + w * pr) / (reached.get(k, 0.0) + w)
            out.append(cum)
        return np.asarray(out, dtype=np.float64)

    def observe(self, source: int, pos: int, conf: float, accepted: bool) -> None:
        """One token observed without being verified: the first token of a chain past
        where it was cut (``pos``: its position in the chain, the cut length), whose
        acceptance the step's output tells for free once every verified token before it
        was accepted (``accepted``: the token sampled after them equals it).

        Why it is needed: :meth:`update` only learns positions that were verified, so a
        bin whose estimate once fell below the cut threshold was never examined again.
        Replaying SmolLM2's greedy outputs of 8 books (``docs/research/greedy_replay.py``, a
        policy pricing a draft token at 12 ms against a 32 ms step, as at batch 8 on the
        CPU), three of them fell into that trap (534, 914 and 907 steps for 1,024 tokens,
        against 269, 257 and 227 with this); in one, a loop whose chains were wholly right
        had them cut after one token for more than 500 tokens: the position-1 bin held
        0.54 from the text before the loop.

        Exact for a greedy request (a draft is accepted iff it is the target's argmax,
        which is what greedy sampling emits) and, for a sampled request, for a point-mass
        draft (an n-gram token): rejection sampling accepts it with probability p(x), and
        the target samples x with probability p(x). Not for a token drawn from a draft
        distribution q (accepted with min(1, p/q)); callers leave those out."""
        k = self._key(source, pos, conf)
        self.reached[k] = self.reached.get(k, 0.0) * self.decay + 1.0
        self.accepted[k] = self.accepted.get(k, 0.0) * self.decay + (1.0 if accepted else 0.0)

    def update(self, sources: Sequence[int], confs: Sequence[float], num_verified: int,
               num_accepted: int) -> None:
        """A verified chain: tokens ``0..num_accepted`` were examined, the first
        ``num_accepted`` accepted."""
        n = min(num_verified, len(sources), len(confs))
        if n <= 0:
            return
        for j in range(min(n, num_accepted + 1)):     # each examined token, booked as observe() books one
            self.observe(sources[j], j, confs[j], j < num_accepted)
