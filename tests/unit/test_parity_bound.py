"""The parity rule of tests/dist/parity.py ([Note: parity bound]) on made-up runs: the floor holds
where DDP is close to single-process PyTorch, twice DDP's distance where it is not, per tensor,
and a difference of the size a bug makes fails either way."""
import pytest
import torch

from tests.dist.parity import PARAM_ABS, assert_parity


def _run(state, losses):
    """A run as the harness returns it: two ranks' results (same losses, norms) and the params."""
    return [{"losses": losses, "norms": [1.0]}] * 2, {k: v.reshape(-1) for k, v in state.items()}


def _ddp(state, losses):
    """A ``ddp_spec`` run as the harness returns it: two ranks' results, each with the state dict."""
    return [{"losses": losses, "norms": [1.0], "state": state}] * 2, None


def _shifted(state, name, by):
    out = {k: v.clone() for k, v in state.items()}
    out[name][0] += by
    return out


REF_STATE = {"w": torch.zeros(3, 2), "b": torch.zeros(2)}
REF = ([2.0], None, REF_STATE)


def test_the_floor_without_ddp_and_where_ddp_is_close():
    close_ddp = _ddp(_shifted(REF_STATE, "w", 1e-7), [2.0])
    for ddp in (None, close_ddp):
        assert_parity(REF, *_run(_shifted(REF_STATE, "w", 0.9 * PARAM_ABS), [2.0]), ddp=ddp)
        with pytest.raises(AssertionError, match="w: max abs diff"):
            assert_parity(REF, *_run(_shifted(REF_STATE, "w", 1.1 * PARAM_ABS), [2.0]), ddp=ddp)
        with pytest.raises(AssertionError, match="step 0: loss"):
            assert_parity(REF, *_run(REF_STATE, [2.0 + 3e-5]), ddp=ddp)


def test_twice_ddps_distance_per_tensor():
    ddp = _ddp(_shifted(REF_STATE, "w", 2e-5), [2.0 + 4e-5])
    assert_parity(REF, *_run(_shifted(REF_STATE, "w", 3.9e-5), [2.0 + 7e-5]), ddp=ddp)
    with pytest.raises(AssertionError, match=r"w: max abs diff: 4\.1.*DDP's own distance 2\.0"):
        assert_parity(REF, *_run(_shifted(REF_STATE, "w", 4.1e-5), [2.0]), ddp=ddp)
    # DDP moved w, not b: b keeps the floor
    with pytest.raises(AssertionError, match="b: max abs diff"):
        assert_parity(REF, *_run(_shifted(REF_STATE, "b", 2e-5), [2.0]), ddp=ddp)
    # a bug's size (an update of lr = 1e-2 lost) fails whatever DDP shows
    with pytest.raises(AssertionError, match="w: max abs diff"):
        assert_parity(REF, *_run(_shifted(REF_STATE, "w", 1e-2), [2.0]), ddp=ddp)


def test_the_gradient_norm_where_ddp_is_given():
    """A gradient averaged with a wrong factor (here 3/4 of it) moves AdamW's update little, but
    the norm by the factor: a test with a DDP reference checks the norm first."""
    ref = ([2.0], [1.0], REF_STATE)
    ddp = _ddp(REF_STATE, [2.0])
    results, params = _run(REF_STATE, [2.0])
    assert_parity(ref, [{**r, "norms": [1.00005]} for r in results], params, ddp=ddp)
    with pytest.raises(AssertionError, match="step 0: gradient norm"):
        assert_parity(ref, [{**r, "norms": [0.75]} for r in results], params, ddp=ddp)


def test_a_ddp_reference_off_at_its_first_step_is_refused():
    """DDP's first step starts from the reference's weights: a gradient norm off there is a
    wrong reference (rows split or weighted wrongly), which would widen every bound it sets."""
    ref = ([2.0], [1.0], REF_STATE)
    results, params = _run(REF_STATE, [2.0])
    assert_parity(ref, results, params, ddp=([{"losses": [2.0], "norms": [1.00005], "state": REF_STATE}] * 2, None))
    with pytest.raises(AssertionError, match="the DDP reference is not"):
        assert_parity(ref, results, params, ddp=([{"losses": [2.0], "norms": [1.036], "state": REF_STATE}] * 2, None))
