"""docs/research/step_trace.py: the per-step tables (the tracing itself needs vLLM and a model)."""

import pytest
from research_utils import load_research


@pytest.fixture(scope="module")
def trace():
    return load_research("step_trace")


def _step(tok, exec_ms, sample_ms, prop_ms, gap_ms, **kw):
    return {"tok": tok, "exec": exec_ms / 1000, "sample": sample_ms / 1000, "prop": prop_ms / 1000,
            "gap": gap_ms / 1000, **kw}


def test_quarters_take_single_token_steps_and_median_over_rounds(trace):
    """Per quarter: the median of each round's median over single-token steps; sampling
    excludes the proposer; multi-token steps are left out."""
    def run(base):
        # 8 steps: quarter q holds steps 2q and 2q+1; exec grows by quarter; one 9-token step
        st = [_step(1, base + q, 2.0, 0.5, 0.25) for q in range(4) for _ in range(2)]
        st[7] = _step(9, 100.0, 50.0, 0.5, 0.25)
        return {"steps": st}

    out = trace._by_quarter({"ar": [run(10.0), run(12.0), run(20.0)]})
    rows = [line.split() for line in out.splitlines()[2:]]
    assert [r[:2] for r in rows] == [["ar", "1"], ["ar", "2"], ["ar", "3"], ["ar", "4"]]
    # exec: rounds give 10+q, 12+q, 20+q -> median 12+q; sampling 2.0 - 0.5; proposer 0.5; gap 0.25
    assert [float(r[2]) for r in rows] == [12.0, 13.0, 14.0, 15.0]
    assert {float(r[3]) for r in rows} == {1.5} and {float(r[4]) for r in rows} == {0.5}
    assert [float(r[6]) for r in rows] == [14.25, 15.25, 16.25, 17.25]


def test_summary_groups_steps_by_the_next_decision(trace):
    steps = [_step(1, 10.0, 2.0, 0.5, 0.2, F=0, U=0, N=0, forced=0, drafted=0, fwd=0.0, fused=0.0)] * 3
    steps += [_step(1, 10.0, 12.0, 8.0, 0.2, F=1, U=0, N=0, forced=1, drafted=4, fwd=0.007, fused=0.0)]
    text = trace._summary("ts", 1.0, steps)
    lines = text.splitlines()
    assert lines[0] == "== ts: wall 1.0 s, 4 steps"
    none = next(line for line in lines if line.strip().startswith("none"))
    f = next(line for line in lines if line.strip().startswith("F "))
    assert none.split()[1] == "3" and f.split()[1] == "1"
    assert float(f.split()[5]) == 8.0 and float(f.split()[6]) == 7.0   # proposer ms, draft forward ms


def test_steps_by_width_split_plain_drafts_tail_and_prefill(trace):
    """Batch 2, k 3: 2 tokens = plain, 3..8 = drafts verified, fewer = tail, more = prefill;
    the drafts' extra milliseconds are over the plain steps' median."""
    st = [_step(2, 1000.0, 100.0, 50.0, 0.0), _step(2, 1200.0, 100.0, 50.0, 0.0),
          _step(2, 1400.0, 100.0, 50.0, 0.0), _step(5, 2000.0, 100.0, 50.0, 0.0),
          _step(8, 3000.0, 100.0, 50.0, 0.0), _step(1, 600.0, 100.0, 50.0, 0.0),
          _step(100, 5000.0, 0.0, 0.0, 0.0)]
    out = trace._by_width({"ts": [{"round": 0, "steps": st}]}, batch_size=2, k=3)
    row = out.splitlines()[2].split()
    assert row[:2] == ["ts", "0"]
    assert [int(row[2]), float(row[3])] == [3, 3.9]              # 3 plain steps: 3.6 + 0.3 s
    assert [int(row[4]), float(row[5])] == [2, 5.2]              # 2 drafting steps: 5.0 + 0.2 s
    assert float(row[6]) == 1300.0 and int(row[7]) == 9          # (2000 + 3000) / 2 - 1200; 3 + 6 drafts
    assert [int(row[8]), float(row[9]), int(row[10]), float(row[11])] == [1, 0.7, 1, 5.0]
    assert float(row[12]) == 0.3                                  # proposer: 6 × 50 ms
