"""KL-penalty coefficient controllers of Ziegler et al. 2019 ("Fine-Tuning Language
Models from Human Preferences", sec. 2.2): a fixed coefficient, and the adaptive
proportional controller that steers the measured KL towards a target.

Owns: the coefficient (`.value`), its update rule, and its state for checkpoints
(`state_dict()` / `load_state_dict()`, plain str/float values only, so JSON or
torch.save both work). Leaves out: how the KL is measured (`trainer/ppo_math.py`)
and when `update` is called (the step loop in `colocate/`).
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol

KL_CONTROLLER_KINDS: tuple[str, ...] = ("fixed", "adaptive")


class KLController(Protocol):
    """What the step loop needs from a KL coefficient controller."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


def _check_kind(state: Mapping[str, Any], kind: str) -> None:
    if state.get("kind") != kind:
        raise ValueError(f"state 'kind' is {state.get('kind')!r}, expected {kind!r}")


class FixedKLController:
    """A constant KL coefficient; `update` does nothing."""

    def __init__(self, coef: float) -> None:
        if coef < 0:
            raise ValueError(f"coef must be >= 0, got {coef}")
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient never changes."""

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "fixed", "value": self.value}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        _check_kind(state, "fixed")
        self.value = float(state["value"])


class AdaptiveKLController:
    """Proportional controller: value *= 1 + clip(kl / target - 1, -0.2, 0.2) * n / horizon.

    `n_steps` is the number of samples (or steps, as the caller counts them) since the
    last update; `horizon` is in the same unit.
    """

    def __init__(self, init_coef: float, target: float, horizon: float) -> None:
        if init_coef <= 0:
            raise ValueError(f"init_coef must be > 0, got {init_coef}")
        if target <= 0:
            raise ValueError(f"target must be > 0, got {target}")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value = float(init_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move the coefficient towards keeping `current_kl` at `target`."""
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly: the value and its hyperparameters."""
        return {"kind": "adaptive", "value": self.value, "target": self.target,
                "horizon": self.horizon}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore value, target and horizon (like an optimizer restores its lr)."""
        _check_kind(state, "adaptive")
        self.value = float(state["value"])
        self.target = float(state["target"])
        self.horizon = float(state["horizon"])


def make_kl_controller(kind: str, coef: float, target: float, horizon: float) -> KLController:
    """Build the controller named by `kind` ("fixed" or "adaptive").

    `coef` is the fixed value or the adaptive initial value; `target` and `horizon`
    are used by the adaptive controller only.
    """
    if kind == "fixed":
        return FixedKLController(coef)
    if kind == "adaptive":
        return AdaptiveKLController(coef, target, horizon)
    raise ValueError(f"kind must be one of {KL_CONTROLLER_KINDS}, got {kind!r}")
