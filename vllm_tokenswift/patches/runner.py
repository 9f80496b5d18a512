"""Patches of vLLM's model runner and worker (``vllm.v1.worker``): the runner hands the
proposer a typed step input (``runner-propose``), frees the state of finished and
preempted requests every step (``runner-state-release``), reaches the worker's counters
by RPC (``worker-stats-rpc``) and samples draft-free steps with the plain sampler
(``draft-free-sampling``).
"""

from __future__ import annotations

from vllm_tokenswift.compat.patching import Patch, Target
from vllm_tokenswift.patches.common import _CPU_RUNNER, _RUNNER, _V32
from vllm_tokenswift.core.config import is_tokenswift_spec
from vllm_tokenswift.engine.step_input import apply_proposal, build_step_input, finished_request_ids


# ------------------------------------------------------------------ runner hooks
def _patch_runner_propose(orig: dict) -> dict:
    orig_fn = orig[f"{_RUNNER}:GPUModelRunner.propose_draft_token_ids"]

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata,
                                hidden_states, sample_hidden_states, aux_hidden_states,
                                spec_decode_metadata, common_attn_metadata, slot_mappings):
        drafter = getattr(self, "drafter", None)
        fn = getattr(drafter, "propose_step", None)
        if fn is not None and is_tokenswift_spec(self.speculative_config):
            self._draft_probs = None
            self._draft_prob_req_ids = None
            step = build_step_input(self, scheduler_output, sampled_token_ids)
            return apply_proposal(self, step, fn(step))
        return orig_fn(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                       sample_hidden_states, aux_hidden_states, spec_decode_metadata,
                       common_attn_metadata, slot_mappings)

    return {f"{_RUNNER}:GPUModelRunner.propose_draft_token_ids": propose_draft_token_ids}


def release_finished_states(runner, scheduler_output) -> int:
    """Free the TokenSwift proposer state of requests that finished or were preempted
    (or resumed: their state is rebuilt) in this scheduler step.

    Called from the runner's ``_update_states`` on every step, including steps that
    schedule no tokens and so never reach the proposer (vLLM flushes finished request
    ids with such a step). Returns how many states were freed (0 for other engines).
    """
    if not is_tokenswift_spec(getattr(runner, "speculative_config", None)):
        return 0
    fn = getattr(getattr(runner, "drafter", None), "release_requests", None)
    if fn is None:
        return 0
    ids = finished_request_ids(scheduler_output)
    return int(fn(ids) or 0) if ids else 0


def _patch_runner_states(orig: dict) -> dict:
    orig_fn = orig[f"{_RUNNER}:GPUModelRunner._update_states"]

    def _update_states(self, scheduler_output):
        release_finished_states(self, scheduler_output)
        return orig_fn(self, scheduler_output)

    return {f"{_RUNNER}:GPUModelRunner._update_states": _update_states}


def _patch_worker(orig: dict) -> dict:
    from vllm_tokenswift.engine.stats_rpc import worker_reset, worker_stats

    def tokenswift_stats(self):
        return worker_stats(self)

    def tokenswift_reset_stats(self):
        return worker_reset(self)

    tokenswift_stats.__doc__ = worker_stats.__doc__
    tokenswift_reset_stats.__doc__ = worker_reset.__doc__
    return {"vllm.v1.worker.worker_base:WorkerBase.tokenswift_stats": tokenswift_stats,
            "vllm.v1.worker.worker_base:WorkerBase.tokenswift_reset_stats": tokenswift_reset_stats}

# ------------------------------------------------------------------ draft-free-sampling
def _patch_draft_free_sampling(orig: dict) -> dict:
    orig_fn = orig[f"{_RUNNER}:GPUModelRunner._sample"]

    def _sample(self, logits, spec_decode_metadata):
        if (spec_decode_metadata is not None and spec_decode_metadata.max_spec_len == 0
                and is_tokenswift_spec(self.speculative_config)):
            # no request verifies a draft: the logits are one row per request, exactly
            # plain decoding's, so plain decoding's sampler gives plain decoding's output
            return orig_fn(self, logits, None)
        return orig_fn(self, logits, spec_decode_metadata)

    return {f"{_RUNNER}:GPUModelRunner._sample": _sample}


#: this subsystem's patches, in the order they are applied
PATCHES: tuple[Patch, ...] = (
    Patch(
        name="runner-propose",
        targets=(Target(f"{_RUNNER}:GPUModelRunner.propose_draft_token_ids", "method",
                        f"{_RUNNER}.GPUModelRunner.propose_draft_token_ids",
                        ("self", "scheduler_output", "sampled_token_ids", "sampling_metadata",
                         "hidden_states", "sample_hidden_states", "aux_hidden_states",
                         "spec_decode_metadata", "common_attn_metadata", "slot_mappings"),
                        (_CPU_RUNNER,)),),
        build=_patch_runner_propose,
        changes="on TokenSwift engines, reads the step into a StepInput (engine/step_input.py: requests, "
                "tokens sampled and verified, positions, sampling parameters, block table), calls "
                "TokenSwiftProposer.propose_step(step) instead of custom_class's propose(), and sets the "
                "runner's _draft_probs / _draft_prob_req_ids from the proposal",
        why="custom_class's propose() gets token ids only: no runner, attention metadata, block "
            "tables, KV cache or sampling metadata, all of which the draft forward needs",
        upstream="no richer custom_class interface in vLLM; no upstream issue filed from here",
        remove_when="custom_class (or Model Runner V2's speculator interface) passes the runner "
                    "context to plugin proposers",
        versions={"0.32": _V32,
                  "0.33": "same signature; the medusa branch was removed from the body; custom_class "
                          "branch unchanged and custom_class still falls back to Model Runner V1"},
    ),
    Patch(
        name="runner-state-release",
        targets=(Target(f"{_RUNNER}:GPUModelRunner._update_states", "method",
                        f"{_RUNNER}.GPUModelRunner._update_states", ("self", "scheduler_output"),
                        (_CPU_RUNNER,)),),
        build=_patch_runner_states,
        changes="before the runner updates its request states, TokenSwiftProposer.release_requests() "
                "frees the state of finished, preempted and resumed requests",
        why="vLLM flushes finished request ids with steps that schedule no tokens and never call the "
            "proposer; without the hook their n-gram tables and views stay until the next draft step",
        upstream="the runner has a per-request removal hook (_on_request_state_removed) only for "
                 "finished requests and only for platform runners; no upstream issue filed from here",
        remove_when="vLLM notifies proposers of finished/preempted requests",
        versions={"0.32": _V32, "0.33": "identical"},
    ),
    Patch(
        name="worker-stats-rpc",
        targets=(Target("vllm.v1.worker.worker_base:WorkerBase.tokenswift_stats", "new"),
                 Target("vllm.v1.worker.worker_base:WorkerBase.tokenswift_reset_stats", "new")),
        build=_patch_worker,
        changes="adds WorkerBase.tokenswift_stats / tokenswift_reset_stats, reachable through "
                "collective_rpc (offline get_engine_stats, the /metrics exporter)",
        why="the proposer's counters live in the worker; collective_rpc calls worker methods by name",
        upstream="not an upstream gap (collective_rpc also takes callables); kept as names so the "
                 "call pickles no code",
        remove_when="never needed upstream; could become a callable passed to collective_rpc",
        versions={"0.32": _V32,
                  "0.33": "WorkerBase changed only set_kv_cache_layout's signature; no name clash"},
    ),
    Patch(
        name="draft-free-sampling",
        targets=(Target(f"{_RUNNER}:GPUModelRunner._sample", "method",
                        f"{_RUNNER}.GPUModelRunner._sample",
                        ("self", "logits", "spec_decode_metadata"), (_CPU_RUNNER,)),),
        build=_patch_draft_free_sampling,
        required=False,
        changes="on TokenSwift engines, a step in which no request verifies a draft token "
                "(SpecDecodeMetadata.max_spec_len == 0) samples with the runner's plain sampler "
                "instead of the rejection sampler; other steps and other engines are unchanged",
        why="the adaptive policy runs plain steps where drafting does not pay; through the "
            "rejection sampler such a step still pays its fixed work (bonus-sampler pass, "
            "logits copies, an empty rejection_sample), which the policy then has to charge "
            "to plain decoding. The logits are one row per request in both paths, and "
            "the plain sampler is what non-speculative decoding runs, so the output is unchanged",
        upstream="vLLM routes every step of a speculative engine through the rejection sampler; "
                 "no upstream issue filed from here",
        remove_when="vLLM skips the rejection sampler for steps without draft tokens",
        versions={"0.32": _V32,
                  "0.33": "checked against the 0.33.0 wheel's source: _sample has the same "
                          "signature and the same spec_decode_metadata is None branch"},
    ),
)
