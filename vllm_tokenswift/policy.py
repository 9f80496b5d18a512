"""Cost-aware drafting policy: what to propose, per request and per engine step.

The paper drafts with a forward of the target over the budgeted view every step.
That forward reads all the weights again; on hardware where a decode step is
bound by reading the weights it costs close to a plain step, and it only pays
when the chain it buys is accepted often enough. This module decides, every
step and for every request, which option maximises expected **generated tokens
per second** of the whole batch, from costs and acceptance measured while the
engine runs (an extension beyond the paper, which always drafts):

* ``forward``: the TokenSwift draft forward over the budgeted view (``l_0..l_3``
  plus n-grams; paper Sec 3.2-3.3);
* ``fused``: no extra forward; the dependent heads are applied to the pre-norm
  hidden state the *verification* forward already computed at the position
  before the newest token (Medusa-style: head i predicts ``t+1+i`` from ``h_t``,
  so head 1 drafts the token after the newest one), plus n-grams;
* ``ngram``: the request's n-gram chain alone (no forward, no heads);
* ``none``: no draft (a plain step for that request).

and how long each chain is.

**Cost model** (:class:`CostModel`). One engine step costs::

    T = a + g·[D>0] + b·D + [any forward]·(f0 + f1·n_fwd) + [any fused]·(h0 + h1·n_fused)

``a``: a step that verifies no draft tokens (the plain decode step of this batch,
plus the proposer's own fixed work); ``g``: the fixed extra cost of a step that
verifies any draft (vLLM's rejection sampler and spec-decode metadata instead of
the plain sampler); ``b``: each verified draft token; ``D``: draft tokens in the
batch; ``f0 + f1·n`` and ``h0 + h1·n``: the draft forward and the fused heads for
``n`` rows. Each is a non-negative ridge least-squares fit over the last
:attr:`CostModel.window` observations (wall-clock, from the proposer's timers),
pulled towards priors expressed as fractions of ``a`` so that a fresh engine starts
with sensible numbers. ``a`` and ``b`` follow context growth and batch-size changes
because old observations leave the window. ``a`` and ``g`` can only be told apart
when some steps verify no draft; when the window holds too few such steps and the
plan's predicted gain over plain decoding is small, :func:`needs_plain_probe` asks
for one plain step.

**Acceptance** (:class:`AcceptanceModel`). Per option and per draft position j,
the probability that draft j is accepted given that drafts ``0..j-1`` were
(``reached``/``accepted`` counts with exponential decay), per request, shrunk
towards the engine-wide figure of the request's group, greedy or sampled (a Beta-style prior of :attr:`prior_weight`
pseudo-observations). Before the chain exists (deciding whether to run a
forward) these per-position means predict the chain; once the chain exists, a
per-token calibration (:class:`Calibration`: acceptance by source, position and
the chain selector's own confidence bin) estimates each token.

**Decision** (:func:`decide`). With ``cum_{r,j}`` the estimated probability that
the first ``j+1`` drafts of request r are accepted, a step generates
``R + Σ_{r,j} cum_{r,j}`` tokens in expectation. Maximising tokens per second
``(R + Σ cum) / T`` over which drafts to include is a ratio problem whose optimum
includes exactly the drafts with ``cum > b·θ*``, ``θ*`` the optimal throughput
(Dinkelbach iteration; a few rounds converge). The fixed costs of the draft
forward and the fused heads are decided by enumerating the on/off combinations,
plus plain decoding (no drafts, no ``g``); each request then takes the option with
the largest surplus
``Σ_j max(0, cum_j − b·θ)``. The chain builder later cuts each chain where its
per-token estimate drops to ``b·θ`` (:attr:`Decision.threshold`).

Determinism: decisions depend on the token history (acceptance counts), the
draft probabilities and the cost model's numbers. Under tensor parallelism the
timings differ per rank, so the proposer broadcasts rank 0's cost model
(:meth:`CostModel.state` / :meth:`CostModel.load_state`) every few steps and all
ranks decide from the same numbers.

Engine-free: numpy only.
"""

from __future__ import annotations

import math
from collections import deque
from itertools import accumulate
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

FORWARD = "forward"
FUSED = "fused"
NGRAM = "ngram"
NONE = "none"
KINDS = (FORWARD, FUSED, NGRAM, NONE)
#: options that propose drafts (``NONE`` proposes nothing)
DRAFT_KINDS = (FORWARD, FUSED, NGRAM)


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

    Priors, as fractions of the draft-free step time ``a`` and of its per-request share
    ``a/R`` (``R``: requests in the step, averaged over the observations): a step that
    verifies any draft pays ``prior_g``·a once (the rejection sampler, the spec-decode
    metadata and the wider logits), each verified draft token ``prior_b``·a (not ``a/R``:
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
    strength: float = 2.0
    step_strength: float = 0.25
    prior_g: float = 0.15
    prior_b: float = 0.08
    prior_forward: float = 0.8
    prior_forward_row: float = 0.3
    prior_fused: float = 0.15
    prior_fused_row: float = 0.05
    refresh_every: int = 1
    #: order of :meth:`state`
    KEYS = ("a", "g", "b", "f0", "f1", "h0", "h1")
    _step: _RidgeFit = field(init=False)
    _fwd: _RidgeFit = field(init=False)
    _fus: _RidgeFit = field(init=False)
    _a0: float | None = field(default=None, init=False)
    _rows: deque = field(default_factory=deque, init=False)
    _plain: int = field(default=0, init=False)
    _frozen: dict | None = field(default=None, init=False)
    _cached: dict | None = field(default=None, init=False)
    _steps_seen: int = field(default=0, init=False)
    _stale_steps: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.refresh_every < 1:
            raise ValueError(f"refresh_every must be >= 1, got {self.refresh_every}")
        self._step = _RidgeFit(3, self.window, self.step_strength)
        self._fwd = _RidgeFit(2, self.window, self.strength)
        self._fus = _RidgeFit(2, self.window, self.strength)

    # ---------------------------------------------------------------- observations
    def observe_step(self, seconds: float, rows: int, draft_tokens: int) -> None:
        """One engine step outside the proposer's forward/fused work: ``seconds`` for
        ``rows`` requests verifying ``draft_tokens`` draft tokens in total."""
        if seconds <= 0 or rows <= 0:
            return
        if self._a0 is None:
            self._a0 = seconds
        if len(self._step) == self.window and self._step.rows[0][0][1] == 0.0:
            self._plain -= 1          # a plain observation leaves the window
        self._step.add((1.0, 1.0 if draft_tokens > 0 else 0.0, draft_tokens), seconds)
        self._plain += draft_tokens <= 0
        self._rows.append(rows)
        while len(self._rows) > self.window:
            self._rows.popleft()
        self._steps_seen += 1
        self._stale_steps += 1
        if self._stale_steps >= self.refresh_every or self._steps_seen <= 2 * self.refresh_every:
            self._cached = None

    def observe_forward(self, seconds: float, rows: int) -> None:
        """One draft forward over ``rows`` requests (view planning included)."""
        if seconds > 0 and rows > 0:
            self._fwd.add((1.0, rows), seconds)
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
        return self._frozen is not None or self._a0 is not None

    def costs(self) -> dict:
        """``{"a", "g", "b", "f0", "f1", "h0", "h1"}`` in seconds (rank 0's numbers once
        :meth:`load_state` was called)."""
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

    def _solve(self) -> dict:
        a_prior = self._a0 if self._a0 is not None else 1.0
        rows = sum(self._rows) / len(self._rows) if self._rows else 1.0
        a, g, b = self._step.solve((a_prior, self.prior_g * a_prior, self.prior_b * a_prior),
                                   (1.0, 1.0, 4.0 * rows))
        a = max(a, 1e-6)
        b = max(b, 1e-4 * a / rows)
        per_row = a / rows
        f0, f1 = self._fwd.solve((self.prior_forward * a, self.prior_forward_row * per_row), (1.0, rows))
        h0, h1 = self._fus.solve((self.prior_fused * a, self.prior_fused_row * per_row), (1.0, rows))
        return {"a": a, "g": g, "b": b, "f0": f0, "f1": f1, "h0": h0, "h1": h1}

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

    Args:
        depth: positions tracked (``num_speculative_tokens``).
        prior_weight: pseudo-observations of the engine-wide figure in a request's
            estimate (and of the initial prior in the engine-wide one).
        initial: option -> prior conditional acceptance per position before anything
            was measured (optimistic enough that every option gets tried).
    """

    depth: int
    prior_weight: float = 8.0
    initial: dict = field(default_factory=lambda: {FORWARD: 0.6, FUSED: 0.4, NGRAM: 0.5})
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

    def chain_cum(self, sources: Sequence[int], confs: Sequence[float]) -> np.ndarray:
        """``cum_j``: the product of :meth:`prob` over the chain's first ``j+1`` tokens
        (``sources``: calibration source keys; ``confs``: the chain selector's
        confidences), float64, length ``min(len(sources), len(confs))``."""
        reached, accepted, w, nb = self.reached, self.accepted, self.prior_weight, self.num_bins
        last = self.positions - 1
        out = []
        cum = 1.0
        for j, (s, c) in enumerate(zip(sources, confs)):   # prob() inlined: one dict key per token
            b = min(nb - 1, max(0, int(c * nb)))
            k = (s, j if j < last else last, b)
            cum *= (accepted.get(k, 0.0) + w * ((b + 0.5) / nb)) / (reached.get(k, 0.0) + w)
            out.append(cum)
        return np.asarray(out, dtype=np.float64)

    def observe(self, source: int, pos: int, conf: float, accepted: bool) -> None:
        """One token observed without being verified: the first token of a chain past
        where it was cut (``pos``: its position in the chain, the cut length), whose
        acceptance the step's output tells for free once every verified token before it
        was accepted (``accepted``: the token sampled after them equals it).

        Why it is needed: :meth:`update` only learns positions that were verified, so a
        bin whose estimate once fell below the cut threshold was never examined again.
        Replaying SmolLM2's greedy outputs of 8 books (``examples/greedy_replay.py``, a
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


# ============================================================== decision
@dataclass
class RowOptions:
    """What one request could do this step: per available option, the estimated
    ``cum_j`` (probability that its first j+1 drafts are accepted).

    Attributes:
        cums: option -> non-increasing array of ``cum_j`` (missing = unavailable).
        forced: an option this request must take this step (exploration, the
            ``"paper"``/``"cycle"`` policies), or None.
    """

    cums: dict
    forced: str | None = None


@dataclass
class Decision:
    """The policy's choice for one step.

    Attributes:
        kinds: per row, the option (``KINDS``).
        lengths: per row, the planned chain length (0 for ``none``).
        threshold: ``b·θ``: the chain builder cuts a chain where its estimated
            cumulative acceptance falls to this value.
        throughput: the expected tokens per second of the chosen plan (θ).
        step_seconds: its expected step time.
        expected_tokens: its expected generated tokens.
    """

    kinds: list
    lengths: list
    threshold: float
    throughput: float
    step_seconds: float
    expected_tokens: float


def _step_seconds(costs: dict, draft_tokens: int, n_fwd: int, n_fus: int) -> float:
    """``T`` of the module doc for a plan with these counts."""
    t = costs["a"] + costs["b"] * draft_tokens
    if draft_tokens > 0:
        t += costs.get("g", 0.0)
    if n_fwd:
        t += costs["f0"] + costs["f1"] * n_fwd
    if n_fus:
        t += costs["h0"] + costs["h1"] * n_fus
    return t


def _candidates(rows: Sequence[RowOptions]) -> list:
    """Per row: ``(forced, [(kind, cum values, prefix sums), ...])`` over the draft options
    it may take (its forced one only, when forced), as Python lists, built once per
    :func:`decide` for all the combinations it tries."""
    cands = []
    for row in rows:
        opts = [row.forced] if row.forced is not None else list(row.cums.keys())
        lst = []
        for kind in opts:
            if kind == NONE or kind not in row.cums:
                continue
            vals = np.asarray(row.cums[kind], dtype=np.float64).tolist()   # Python floats
            lst.append((kind, vals, [0.0, *accumulate(vals)]))
        cands.append((row.forced is not None, lst))
    return cands


def _no_plan_beats(cands: list, costs: dict, theta0: float) -> bool:
    """True only when no plan that drafts can exceed ``theta0`` tokens/s (a sufficient
    test; always False when a row is forced, which must draft even at a loss).

    Dinkelbach's test at ``θ0``: a plan beats ``θ0`` only if ``R + gain - θ0·T > 0``.
    For the plans that may use the options of one fixed-cost combination (n-gram chains,
    plus the draft forward and/or the fused heads with their fixed costs ``f0``/``h0``
    charged, and ``g`` charged always: a plan without drafts gives ``R - θ0·a <= 0``
    anyway), the largest value separates over the rows: each row adds the best of 0 and
    its options' ``Σ_j max(0, cum_j - θ0·b)``, less ``θ0·f1`` (``θ0·h1``) for the
    forward (fused heads). A plan that uses fewer options than its combination is
    counted, with the right fixed costs, by the smaller combination. So when every
    combination's value is at most 0, so is every plan's. O(rows × options × k)."""
    if any(forced for forced, _lst in cands):
        return False
    a, b = costs["a"], costs["b"]
    cut = b * theta0
    tot = [0.0, 0.0, 0.0, 0.0]      # {ngram}, {ngram, forward}, {ngram, fused}, all
    has_fwd = has_fus = False
    for _forced, lst in cands:
        s_ng = s_fw = s_fu = 0.0
        for kind, vals, _pre in lst:
            sur = 0.0
            for v in vals:
                if v > cut:
                    sur += v - cut
            if kind == NGRAM:
                s_ng = sur
            elif kind == FORWARD:
                has_fwd = True
                s_fw = sur - theta0 * costs["f1"]
            elif kind == FUSED:
                has_fus = True
                s_fu = sur - theta0 * costs["h1"]
        tot[0] += s_ng
        tot[1] += max(s_ng, s_fw)
        tot[2] += max(s_ng, s_fu)
        tot[3] += max(s_ng, s_fw, s_fu)
    R = len(cands)
    base = a + costs.get("g", 0.0)
    values = [R - theta0 * base + tot[0]]
    if has_fwd:
        values.append(R - theta0 * (base + costs["f0"]) + tot[1])
    if has_fus:
        values.append(R - theta0 * (base + costs["h0"]) + tot[2])
    if has_fwd and has_fus:
        values.append(R - theta0 * (base + costs["f0"] + costs["h0"]) + tot[3])
    return max(values) < -1e-9 * R


def _plan(cands: list, allowed: set, costs: dict, iters: int = 6):
    """Best plan when only ``allowed`` options exist: Dinkelbach on the throughput.

    ``cands``: :func:`_candidates` of the rows. Every Dinkelbach round costs
    O(rows × options × k) float comparisons: an option's surplus at cut ``c`` is
    ``Σ_j max(0, cum_j - c)`` over its prefix of drafts with ``cum_j > c`` (``cum`` is
    non-increasing). Done with numpy on arrays of at most k values, :func:`decide` took
    4x longer at 8 rows (0.36 against 0.09 ms)."""
    R = len(cands)
    b = costs["b"]
    theta = R / costs["a"]  # plain decoding's throughput as the first guess
    kinds = [NONE] * R
    lens = [0] * R
    t = costs["a"]
    gain = 0.0
    for _ in range(iters):
        cut = b * theta
        gain = 0.0
        ntok = 0
        n_fwd = n_fus = 0
        for i, (forced, lst) in enumerate(cands):
            best, best_s, best_k, best_gain = NONE, 0.0, 0, 0.0
            for kind, vals, pre in lst:
                if kind not in allowed:
                    continue
                k = 0
                for v in vals:             # non-increasing: the drafts worth more than the cut
                    if not v > cut:
                        break
                    k += 1
                if forced:
                    k = max(k, 1) if vals else 0   # a forced option drafts at least one token
                    s = pre[k] - cut * k + 1e9
                else:
                    s = pre[k] - cut * k
                if s > best_s:
                    best, best_s, best_k, best_gain = kind, s, k, pre[k]
            kinds[i], lens[i] = best, best_k
            gain += best_gain
            ntok += best_k
            n_fwd += best == FORWARD
            n_fus += best == FUSED
        t = _step_seconds(costs, ntok, n_fwd, n_fus)
        new_theta = (R + gain) / t
        if abs(new_theta - theta) <= 1e-9 * max(theta, 1e-12):
            theta = new_theta
            break
        theta = new_theta
    return theta, list(kinds), list(lens), t, R + gain


def plain_decision(rows: Sequence[RowOptions], costs: dict) -> Decision:
    """Plain decoding for every request: no drafts, step time ``a``, ``R/a`` tokens/s."""
    R = len(rows)
    a = costs["a"]
    return Decision([NONE] * R, [0] * R, costs["b"] * R / a, R / a, a, float(R))


#: Relative margin by which a drafting plan's predicted throughput must beat plain
#: decoding's before :func:`decide` takes it on its own (exploration and probes aside).
#: The estimates it compares are noisy, and a plan chosen because its estimate is high
#: is on average worse than estimated (the winner's curse): measured on SmolLM2 at 6K
#: tokens under the paper's sampling, drafting steps chosen near break-even cost more
#: than they returned (draft forward and verification 17 s for 13 s of saved steps).
MIN_GAIN = 0.05

#: the fixed-cost combinations :func:`decide` enumerates (``{NONE}``: plain decoding)
_COMBOS = (frozenset({NONE}), frozenset({NGRAM, NONE}), frozenset({NGRAM, NONE, FORWARD}),
           frozenset({NGRAM, NONE, FUSED}), frozenset({NGRAM, NONE, FORWARD, FUSED}))


def decide(rows: Sequence[RowOptions], costs: dict, min_gain: float = MIN_GAIN) -> Decision:
    """Choose every request's option and chain length to maximise expected tokens/s.

    Enumerates plain decoding and the fixed-cost options (draft forward on/off ×
    fused heads on/off, n-gram chains always allowed); for each, finds the best plan
    (see module doc) and keeps the best throughput. A plan that switches the forward
    on but gives it no row is the same as the plan without it, so it is never
    preferred; a plan that drafts pays ``g`` once, so plain decoding wins when the
    expected accepted tokens do not cover it. Combinations that do not allow a
    request's forced option are skipped. Plain decoding, when allowed, also wins
    unless the best drafting plan beats it by more than ``min_gain`` (relative).
    When no drafting plan can beat that margin (:func:`_no_plan_beats`), plain
    decoding is returned without planning (the same decision, found in
    O(rows × options × k): most steps of a sampled request end here).

    Args:
        rows: per request (batch order), its :class:`RowOptions`.
        costs: :meth:`CostModel.costs` (``g`` may be absent: 0).
        min_gain: margin over plain decoding a drafting plan needs (see
            :data:`MIN_GAIN`; 0: pure expected-throughput maximisation).
    Returns:
        :class:`Decision`.
    """
    if not rows:
        return Decision([], [], 0.0, 0.0, 0.0, 0.0)
    forced_kinds = {r.forced for r in rows if r.forced is not None}
    cands = _candidates(rows)
    margin = 1 + max(0.0, min_gain)
    if _no_plan_beats(cands, costs, margin * len(rows) / costs["a"]):   # False with forced rows
        return plain_decision(rows, costs)
    best = plain = None
    for allowed in _COMBOS:
        if not forced_kinds <= allowed:
            continue
        if allowed == {NONE}:
            d = plain_decision(rows, costs)
            plain = (d.throughput, d.kinds, d.lengths, d.step_seconds, d.expected_tokens)
            continue
        plan = _plan(cands, allowed, costs)
        if best is None or plan[0] > best[0] * (1 + 1e-12):
            best = plan
    if plain is not None and (best is None or not any(best[2])
                              or best[0] <= plain[0] * margin):
        best = plain
    theta, kinds, lens, t, tokens = best
    return Decision(kinds, lens, costs["b"] * theta, theta, t, tokens)


def needs_plain_probe(decision: Decision, rows: Sequence[RowOptions], costs: dict,
                      plain_obs: int, min_plain: int = 4, margin: float = 1.3) -> bool:
    """Whether to run a plain step instead of ``decision`` to measure ``a`` apart from ``g``.

    When every recent step verified drafts, the step fit only knows ``a + g`` and
    falls back on the prior for the split; a wrong split biases every later choice
    between drafting and plain decoding. A probe is worth its cost only when the
    choice is close: the decision drafts, no request is forced to draft
    (exploration), fewer than ``min_plain`` plain steps are in the cost model's window
    and the plan's predicted throughput is below ``margin`` × plain decoding's.

    Args:
        decision: :func:`decide`'s choice for this step.
        rows: the same rows.
        costs: the same costs.
        plain_obs: :meth:`CostModel.plain_observations`.
    Returns:
        True: take :func:`plain_decision` this step.
    """
    if not rows or not any(decision.lengths) or any(r.forced is not None for r in rows):
        return False
    if plain_obs >= min_plain:
        return False
    return decision.throughput < margin * len(rows) / costs["a"]


def expected_tokens_per_second(cums: Sequence[np.ndarray], costs: dict, *, forward_rows: int = 0,
                               fused_rows: int = 0) -> float:
    """``(R + Σ cum) / T`` for given chains (``D`` = their total length, ``T`` as in the
    module doc); the arithmetic :func:`decide` maximises, exposed for reports and tests."""
    R = len(cums)
    D = sum(len(c) for c in cums)
    t = _step_seconds(costs, D, forward_rows, fused_rows)
    return (R + float(sum(float(np.sum(c)) for c in cums))) / t


def cut_length(cum: Sequence[float], threshold: float) -> int:
    """Longest prefix whose cumulative estimates all exceed ``threshold`` (at least 0)."""
    k = 0
    for c in cum:
        if c <= threshold or not math.isfinite(c):
            break
        k += 1
    return k
