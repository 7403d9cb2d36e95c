"""trainer/kl_control.py: the adaptive controller against a hand computation, state round-trips,
and the factory's errors."""

import json

import pytest

from colocate.trainer.kl_control import AdaptiveKLController, FixedKLController, make_kl_controller


def test_adaptive_kl_controller_matches_hand_computation_and_round_trips():
    ctl = make_kl_controller("adaptive", coef=0.2, target=6.0, horizon=10000)
    # error clipped to +0.2 (kl 8), 0 (kl 6), clipped to -0.2 (kl 3), +0.1 (kl 6.6)
    multipliers = [1.00512, 1.0, 0.98976, 1.001]
    expected = 0.2
    for (kl, n), mult in zip([(8.0, 256), (6.0, 256), (3.0, 512), (6.6, 100)], multipliers):
        ctl.update(kl, n)
        expected *= mult
        assert ctl.value == pytest.approx(expected, rel=1e-12)
    fresh = AdaptiveKLController(1.0, 1.0, 1.0)
    fresh.load_state_dict(json.loads(json.dumps(ctl.state_dict())))
    assert fresh.state_dict() == ctl.state_dict() == {
        "kind": "adaptive", "value": ctl.value, "target": 6.0, "horizon": 10000.0}
    fresh.update(7.0, 300)
    ctl.update(7.0, 300)
    assert fresh.value == ctl.value
    with pytest.raises(ValueError, match="kind"):
        FixedKLController(0.1).load_state_dict(ctl.state_dict())


def test_fixed_kl_controller_and_factory_errors():
    ctl = make_kl_controller("fixed", coef=0.05, target=6.0, horizon=10000)
    ctl.update(100.0, 1000)
    assert ctl.value == 0.05 and ctl.state_dict() == {"kind": "fixed", "value": 0.05}
    with pytest.raises(ValueError, match="kind"):
        make_kl_controller("pid", 0.1, 6.0, 10000)
    with pytest.raises(ValueError, match="horizon"):
        make_kl_controller("adaptive", 0.1, 6.0, 0)
