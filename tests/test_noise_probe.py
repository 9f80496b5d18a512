"""docs/research/noise_probe.py: its engine-free part (the steal-time reader)."""

import pytest

from research_utils import load_research

probe = load_research("noise_probe")


def test_steal_seconds_reads_the_eighth_value_of_the_cpu_line():
    text = "cpu  392794 0 73029 125197 1209 0 310 10615 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n"
    assert probe.steal_seconds(text, 100) == pytest.approx(106.15)
    assert probe.steal_seconds(text, 250) == pytest.approx(42.46)


@pytest.mark.parametrize("bad", ["cpu0 1 2 3 4 5 6 7 8 9\n", "cpu 1 2 3\n", "intr 1 2\n"])
def test_steal_seconds_refuses_other_text(bad):
    with pytest.raises(ValueError, match="aggregate 'cpu' line"):
        probe.steal_seconds(bad, 100)
