"""Drafting policies: what each request proposes, per engine step.

The proposer reaches a policy through the interface of :class:`DraftingPolicy`
(:mod:`~vllm_tokenswift.core.policy.base`: ``account``, ``plan``, ``cut``). The strategies the
plugin ships, selected by ``"tokenswift": {"policy": NAME}``:

* ``"adaptive"`` (default, :class:`~vllm_tokenswift.core.policy.adaptive.AdaptivePolicy`):
  expected tokens per second from measured costs and acceptance
  (:mod:`~vllm_tokenswift.core.policy.decision`, :mod:`~vllm_tokenswift.core.policy.estimates`);
* ``"paper"`` (:class:`~vllm_tokenswift.core.policy.paper.PaperPolicy`): the draft forward
  every step, chains whole;
* ``"triforce"`` (:class:`~vllm_tokenswift.core.policy.paper.TriForcePolicy`): a
  self-speculative chain every step (the paper's TriForce* baseline);
* ``"medusa"`` (:class:`~vllm_tokenswift.core.policy.paper.MedusaPolicy`): the heads on the
  verification forward's hidden state every step (the paper's Medusa* baseline);
* ``"cycle"`` (:class:`~vllm_tokenswift.core.policy.adaptive.CyclePolicy`): every option in
  turn (diagnostics and tests).

Any other strategy is named by its class path, ``"package.module:Class"`` (a
:class:`DraftingPolicy` subclass); :func:`policy_class` resolves names and paths in one place.

Engine-free (numpy).
"""

from __future__ import annotations

import importlib

from vllm_tokenswift.core.config import TokenSwiftConfigError
from vllm_tokenswift.core.policy.adaptive import AdaptivePolicy, CyclePolicy
from vllm_tokenswift.core.policy.base import DraftingPolicy
from vllm_tokenswift.core.policy.paper import MedusaPolicy, PaperPolicy, TriForcePolicy

#: the built-in strategies by name (``config.BUILTIN_POLICIES`` lists the same names)
POLICIES: dict[str, type[DraftingPolicy]] = {p.name: p for p in (AdaptivePolicy, PaperPolicy, CyclePolicy, TriForcePolicy,
                                                              MedusaPolicy)}

__all__ = ["POLICIES", "DraftingPolicy", "AdaptivePolicy", "PaperPolicy", "CyclePolicy", "TriForcePolicy",
           "MedusaPolicy", "policy_class", "check_policy", "make_policy"]


def policy_class(name: str) -> type[DraftingPolicy]:
    """The strategy class ``"tokenswift": {"policy": name}`` selects: a built-in name or a
    ``"package.module:Class"`` path.

    Raises:
        TokenSwiftConfigError: an unknown name, a path that does not import, or a class that
            is not a :class:`DraftingPolicy` subclass.
    """
    if name in POLICIES:
        return POLICIES[name]
    mod, sep, attr = name.partition(":")
    if not sep:
        raise TokenSwiftConfigError(f"unknown drafting policy {name!r}: use one of {', '.join(POLICIES)} "
                                    "or a 'package.module:Class' path")
    try:
        cls = getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as e:
        raise TokenSwiftConfigError(f"drafting policy {name!r} cannot be imported: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, DraftingPolicy)):
        raise TokenSwiftConfigError(f"drafting policy {name!r} is not a subclass of "
                                    "vllm_tokenswift.core.policy.DraftingPolicy")
    return cls


def check_policy(cfg) -> type[DraftingPolicy]:
    """The strategy class of ``cfg.policy`` (:func:`policy_class`), its own checks of the
    settings passed (:meth:`DraftingPolicy.check_config`); run in the front end when the
    engine is created.

    Raises:
        TokenSwiftConfigError: as :func:`policy_class`, or settings the strategy refuses.
    """
    cls = policy_class(cfg.policy)
    try:
        cls.check_config(cfg)
    except ValueError as e:
        raise TokenSwiftConfigError(f"tokenswift.policy={cfg.policy!r}: {e}") from None
    return cls


def make_policy(cfg, num_spec_tokens: int, tp_broadcast=None) -> DraftingPolicy:
    """The engine's strategy instance for ``cfg.policy`` (:func:`check_policy`)."""
    return check_policy(cfg)(cfg, num_spec_tokens, tp_broadcast)
