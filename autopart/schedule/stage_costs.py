"""What a schedule's actions cost: seconds per microbatch for every stage, and per boundary
between stages, as `autopart.schedule.simulate` and the step model read them."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field

from autopart.ir.errors import ConfigError
from autopart.ir.actions import Action, Kind

__all__ = ["StageCosts"]


@dataclass(frozen=True, kw_only=True)
class StageCosts:
    """Seconds per microbatch for every virtual stage, and per boundary between stages."""

    forward_s: tuple[float, ...]
    """Forward of one microbatch, per stage."""
    backward_s: tuple[float, ...]
    """Full backward (input and weight gradients) of one microbatch, per stage; B takes this."""
    weight_s: tuple[float, ...]
    """The weight-gradient part of ``backward_s``: W takes this, I takes the rest."""
    transfer_s: tuple[float, ...]
    """Per boundary s -> s+1 (so one fewer than stages): moving one microbatch's activation
    across ranks, and the same for its gradient coming back, from the end of the send to the
    data being on the receiving rank."""
    send_s: tuple[float, ...] = ()
    """Per boundary: rank time of one send (posting the message: gloo does it on the caller's
    thread and its own); empty for none. A send follows its compute at once, so its data leaves
    ``send_s`` after the compute ends."""
    recv_s: tuple[float, ...] = ()
    """Per boundary: rank time of one receive once the data is there (completing it, waking up);
    empty for none."""
    recv_waited_s: tuple[float, ...] = ()
    """Per boundary: rank time of a receive that waited for its data, from the data being there
    (`autopart.schedule.shared.step_time`; gloo completes a posted receive as its send does,
    sooner than one whose data came first); empty: ``recv_s``."""
    gradients: tuple[bool, ...] = ()
    """Per boundary: whether a gradient comes back across it (empty: over every one). Over a
    boundary that nothing trained lies before (`autopart.ir.plan.StagePlan.no_grad_inputs`) the
    runtime's gradient messages carry nothing: the stage before it waits for none, and its send
    and receive take no rank time."""
    actions: Mapping[Action, float] = field(default_factory=dict, hash=False)
    """Rank time of single actions in place of their stage's figure above: one step of a
    pipeline that was run, replayed (`autopart.driver`'s step model)."""

    def __post_init__(self) -> None:
        stages = len(self.forward_s)
        if stages == 0:
            raise ConfigError(
                "StageCosts needs at least one stage; give forward_s a value per stage"
            )
        for name in ("backward_s", "weight_s"):
            if len(getattr(self, name)) != stages:
                raise ConfigError(
                    f"StageCosts.{name} has {len(getattr(self, name))} values but forward_s has "
                    f"{stages}; give one value per stage"
                )
        for name in ("transfer_s", "send_s", "recv_s", "recv_waited_s"):
            given = len(getattr(self, name))
            if given != stages - 1 and not (name != "transfer_s" and given == 0):
                raise ConfigError(
                    f"StageCosts.{name} has {given} values for {stages} stages; "
                    f"give one per boundary ({stages - 1})"
                )
        if len(self.gradients) not in (0, stages - 1):
            raise ConfigError(f"StageCosts.gradients has {len(self.gradients)} values for {stages} stages; "
                              f"give one per boundary ({stages - 1}) or none")
        if self.recv_waited_s and not self.recv_s:
            raise ConfigError("StageCosts.recv_waited_s needs recv_s: it replaces a receive's time when it waited")
        for name in ("forward_s", "backward_s", "weight_s", "transfer_s", "send_s", "recv_s", "recv_waited_s"):
            if any(value < 0 for value in getattr(self, name)):
                raise ConfigError(f"StageCosts.{name} has a negative time; times are seconds >= 0")
        if any(value < 0 for value in self.actions.values()):
            raise ConfigError("StageCosts.actions has a negative time; times are seconds >= 0")
        for stage, (backward, weight) in enumerate(
            zip(self.backward_s, self.weight_s, strict=True)
        ):
            if weight > backward:
                raise ConfigError(
                    f"stage {stage}: weight_s ({weight}) is more than backward_s ({backward}); "
                    "weight_s is the weight-gradient part of the backward"
                )

    @classmethod
    def uniform(
        cls,
        stages: int,
        *,
        forward_s: float,
        backward_s: float,
        weight_s: float = 0.0,
        transfer_s: float = 0.0,
    ) -> StageCosts:
        """The same costs on every stage and boundary: the balanced pipeline of the papers."""
        return cls(
            forward_s=(forward_s,) * stages,
            backward_s=(backward_s,) * stages,
            weight_s=(weight_s,) * stages,
            transfer_s=(transfer_s,) * (stages - 1),
        )

    @property
    def stages(self) -> int:
        return len(self.forward_s)

    @property
    def messages_take_rank_time(self) -> bool:
        """Whether a send or a receive takes its rank's time (or single actions have their own):
        where none does, a schedule's compute order alone times as its lowering does
        (`autopart.schedule.simulate`), with a third of the actions and no lowering to build."""
        return bool(self.actions) or any(self.send_s) or any(self.recv_s) or any(self.recv_waited_s)

    @functools.cached_property
    def durations(self) -> dict[Kind, tuple[float, ...]]:
        """Per kind, per stage: `duration` of that stage's action, ``actions`` aside (the
        simulators read it where ``actions`` is empty: a method call per action cost them more
        than the rest of its step, at a million actions)."""
        def by_stage(per_boundary: tuple[float, ...], *, boundary_before: bool, gradient: bool = False
                     ) -> tuple[float, ...]:
            values = per_boundary or (0.0,) * (self.stages - 1)  # none given: messages take no rank time
            if gradient:
                values = tuple(v if self.gradient_crosses(b) else 0.0 for b, v in enumerate(values))
            return (0.0, *values) if boundary_before else (*values, 0.0)

        return {
            Kind.F: self.forward_s,
            Kind.B: self.backward_s,
            Kind.I: tuple(b - w for b, w in zip(self.backward_s, self.weight_s)),
            Kind.W: self.weight_s,
            Kind.SEND_F: by_stage(self.send_s, boundary_before=False),  # stage s sends over boundary s
            Kind.SEND_B: by_stage(self.send_s, boundary_before=True, gradient=True),  # over boundary s - 1
            Kind.RECV_F: by_stage(self.recv_s, boundary_before=True),
            Kind.RECV_B: by_stage(self.recv_s, boundary_before=False, gradient=True),
        }

    def gradient_crosses(self, boundary: int) -> bool:
        """Whether a gradient comes back over ``boundary`` (s for s -> s + 1): see `gradients`."""
        return not self.gradients or self.gradients[boundary]

    def duration(self, action: Action) -> float:
        """Rank time that an action takes."""
        if self.actions and action in self.actions:  # hashing an Action costs: most plans have none
            return self.actions[action]
        stage = action.stage
        if action.kind is Kind.F:
            return self.forward_s[stage]
        if action.kind is Kind.B:
            return self.backward_s[stage]
        if action.kind is Kind.I:
            return self.backward_s[stage] - self.weight_s[stage]
        if action.kind is Kind.W:
            return self.weight_s[stage]
        if action.kind in (Kind.SEND_B, Kind.RECV_B) and not self.gradient_crosses(_boundary(action)):
            return 0.0  # an empty message
        side = self.send_s if action.kind in (Kind.SEND_F, Kind.SEND_B) else self.recv_s
        return side[_boundary(action)] if side else 0.0

    def waited_duration(self, action: Action) -> float:
        """Rank time of a receive that waited for its data: `duration` with `recv_waited_s` in
        place of `recv_s` (a replayed step's lateness kept)."""
        if not self.recv_waited_s or (action.kind is Kind.RECV_B and not self.gradient_crosses(_boundary(action))):
            return self.duration(action)
        boundary = _boundary(action)
        return max(0.0, self.duration(action) - self.recv_s[boundary] + self.recv_waited_s[boundary])


def _boundary(message: Action) -> int:
    """The boundary between stages that a send or receive crosses (s for s -> s + 1)."""
    return min(message.stage, message.peer_stage)
