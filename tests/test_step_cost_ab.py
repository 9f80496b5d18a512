"""docs/research/step_cost_ab.py: the per-request decode time (the runs themselves need vLLM and a model)."""

from types import SimpleNamespace

import pytest
from research_utils import load_research


@pytest.fixture(scope="module")
def ab():
    return load_research("step_cost_ab")


def _out(first_ts, last_ts, n):
    return SimpleNamespace(metrics=SimpleNamespace(first_token_ts=first_ts, last_token_ts=last_ts,
                                                   first_token_latency=first_ts),
                           outputs=[SimpleNamespace(token_ids=list(range(n)))])


def test_decode_time_is_each_requests_own_first_to_last_token_median_over_requests(ab):
    # 201 tokens each: 200 gaps. Request 0 starts 2.5 s late (the case the old formula got
    # wrong) but its own decode is 30 s like the others'; request 3 decodes slower (32 s).
    results = [_out(3.0, 33.0, 201), _out(0.5, 30.5, 201), _out(0.5, 30.5, 201), _out(0.5, 32.5, 201)]
    assert ab._decode_ms_per_token(results) == pytest.approx(150.0)
    # (the run's wall time, 33.0 s, minus request 0's 3.0 s to first token would say the same
    # here; had request 0 finished with the others at 30.5 s, it would say 137.5 ms)


def test_decode_time_is_none_without_timestamps_or_tokens(ab):
    assert ab._decode_ms_per_token([_out(0.0, 0.0, 201)]) is None      # log stats off
    assert ab._decode_ms_per_token([_out(1.0, 2.0, 1)]) is None        # one token: no decode
    assert ab._decode_ms_per_token([_out(1.0, 2.0, 11), _out(0.0, 0.0, 11)]) is None
    assert ab._decode_ms_per_token([_out(1.0, 2.0, 11)]) == pytest.approx(100.0)


def test_ratio_lines_pair_runs_by_repeat(ab, capsys):
    import sys
    runs = [{"mode": "ar", "wall_ms_per_tok": 100.0}, {"mode": "ts", "wall_ms_per_tok": 125.0},
            {"mode": "ar", "wall_ms_per_tok": 120.0}, {"mode": "ts", "wall_ms_per_tok": 120.0}]
    ab._print_ratios(runs, ["ar", "ts"], "wall_ms_per_tok", " whole run:", sys.stdout)
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == ("ts          whole run: median  122.50 ms/token  speed vs ar: median 0.900x "
                        "(per round: 0.800, 1.000)")
