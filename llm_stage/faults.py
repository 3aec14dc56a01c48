"""Faults a test can arm on an engine, to see a step fail the way a real bug would surface.

Never armed in serving: the engine checks an empty dict at two places per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

# "compute": the forward or the sampling fails (the step's sequences can be failed, the rest go on);
# "schedule": the scheduler itself fails (the engine's state can no longer be trusted).
Phase = Literal["compute", "schedule"]


class InjectedFault(RuntimeError):
    """Raised by an armed :class:`StepFaults`."""


@dataclass(slots=True)
class StepFaults:
    armed: dict[str, int] = field(default_factory=dict)  # phase → steps left to fail

    def arm(self, phase: Phase, times: int = 1) -> None:
        self.armed[phase] = times

    def check(self, phase: Phase) -> None:
        left = self.armed.get(phase, 0)
        if left:
            self.armed[phase] = left - 1
            raise InjectedFault(f"injected {phase} fault")
