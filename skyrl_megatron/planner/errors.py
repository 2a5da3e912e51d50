"""The planner's one error type: which command-line flag is wrong, why, and how to fix it."""

from __future__ import annotations


class PlanError(ValueError):
    """Bad planner input. `flag` is the `skyrl-megatron plan` option to change."""

    def __init__(self, flag: str, message: str, fix: str):
        self.flag, self.message, self.fix = flag, message, fix
        super().__init__(f"{flag}: {message}. Fix: {fix}")
