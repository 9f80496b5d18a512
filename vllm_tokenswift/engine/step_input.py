"""The proposer's view of one vLLM engine step: :func:`build_step_input` reads it from the
model runner once per step (the runner patch, ``runner-propose``), :func:`apply_proposal`
writes the proposal's draft distributions back, and :func:`finished_request_ids` names the
requests whose proposer state must go (``runner-state-release``).

The runner's internals read here, and nowhere else in the proposer (vLLM 0.32/0.33
``GPUModelRunner``, inherited by ``CPUModelRunner``): ``input_batch`` (``req_ids``,
``num_tokens_no_spec``, ``token_ids_cpu``, ``block_table[0]``), ``query_start_loc``,
``requests[req_id].sampling_params``, ``device``; the ``SchedulerOutput``'s
``scheduled_spec_decode_tokens`` and ``total_num_scheduled_tokens``.
"""

from __future__ import annotations

import torch

from vllm_tokenswift.core.step import RequestStep, StepInput, StepProposal


def build_step_input(runner, scheduler_output, sampled) -> StepInput:
    """The :class:`~vllm_tokenswift.core.step.StepInput` of this step.

    Args:
        runner: vLLM's ``GPUModelRunner`` (or ``CPUModelRunner``) after sampling.
        scheduler_output: the step's ``SchedulerOutput``.
        sampled: per batch row, the tokens sampled this step (accepted drafts + bonus);
            ``[]`` for rows mid-prefill or discarded.
    """
    ib = runner.input_batch
    req_ids = list(ib.req_ids[: len(sampled)])
    spec = scheduler_output.scheduled_spec_decode_tokens
    qsl = runner.query_start_loc.np
    bt = ib.block_table[0]
    nblk = bt.num_blocks_per_row
    block_size = int(runner.cache_config.block_size)
    requests = []
    for i, s in enumerate(sampled):
        if not s or i >= len(ib.req_ids):
            continue
        rid = ib.req_ids[i]
        p = int(ib.num_tokens_no_spec[i]) - 1
        k = len(spec.get(rid, ()))
        a = len(s) - 1
        req = runner.requests.get(rid)
        requests.append(RequestStep(
            batch_row=i, req_id=rid, sampled=s, num_verified=k, pos=p,
            verify_index=int(qsl[i + 1]) - 1 - (k - a), has_slot=p // block_size < int(nblk[i]),
            sampling_params=getattr(req, "sampling_params", None), num_slots=int(nblk[i]) * block_size))
    return StepInput(requests=requests, req_ids=req_ids,
                     num_scheduled_tokens=int(scheduler_output.total_num_scheduled_tokens),
                     token_ids=ib.token_ids_cpu, block_table=bt.block_table.np,
                     device=torch.device(runner.device), runner=runner)


def apply_proposal(runner, step: StepInput, proposal: StepProposal) -> list[list[int]]:
    """Hand ``proposal`` to the runner: its draft distributions become
    ``runner._draft_probs`` (read by ``_get_spec_decode_draft_probs`` when the next step
    verifies; None: every draft a point mass) with ``_draft_prob_req_ids``; returns the
    draft token ids, which the runner returns as ``propose_draft_token_ids``'s result."""
    runner._draft_probs = proposal.draft_probs
    runner._draft_prob_req_ids = list(step.req_ids) if proposal.draft_probs is not None else None
    return proposal.draft_token_ids


def finished_request_ids(scheduler_output) -> set[str]:
    """Ids of the requests whose proposer state must go after this scheduler step: those
    that finished (or were aborted), were preempted, or were resumed (their state is
    rebuilt from their tokens).

    Args:
        scheduler_output: vLLM's ``SchedulerOutput`` of the step.
    """
    ids = set(getattr(scheduler_output, "finished_req_ids", None) or ())
    ids |= set(getattr(scheduler_output, "preempted_req_ids", None) or ())
    cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
    ids |= set(getattr(cached, "resumed_req_ids", None) or ())
    return ids
