"""The step simulator against the published figures (tests/plan_published.py, which names each
source): the ZeRO paper's Table 1 as zeroray holds the states, its largest models and throughputs
as its own systems held them, and torchtitan's Llama 3.1 8B FSDP runs on H100. Arithmetic only, no
measurement: each row is ``plan.simulate``'s prediction against the published figure and its bound.
The formula's own test (Table 1 from ``estimate_memory``) is tests/unit/test_memory.py's."""
import pytest

from tests import plan_published

ROWS = plan_published.rows()


@pytest.mark.parametrize("row", ROWS, ids=[r.name.split(" (")[0] for r in ROWS])
def test_published_figure(row):
    assert row.ok, f"{row.name}: predicted {row.predicted:,.4g}, published {row.reference:,.4g} ({row.error:+.1%}, " \
                   f"bound ±{row.bound:.0%}{' or ' + row.side if row.side else ''})"


def test_table1_departures_are_zerorays_and_the_papers_own_states_reproduce_it():
    """zeroray's departures (fp32 gradient, stage 1's shard) are what separates its states from Table 1:
    the simulator holding the states as the paper does gives the paper's figures."""
    from zeroray import plan

    w = plan_published.table1_model()
    v100 = plan.cluster_preset("v100-32gb")
    paper = [plan.simulate(w, v100, plan.RunConfig(s, 64, dtype="fp16", states="paper")).memory["states"] / 1e9
             for s in range(4)]
    assert paper == pytest.approx([120, 31.4, 16.6, 1.88], rel=0.005)
    zeroray = [r.predicted for r in ROWS[:4]]
    assert zeroray[0] - paper[0] == pytest.approx(2 * 7.5)  # the fp32 gradient: 2 more bytes per parameter
    assert zeroray[1] == pytest.approx(zeroray[2])          # stage 1 holds stage 2's gradient shard
