"""Preemption: a signal to the driver (`trainer.preemption_signal`, SIGTERM by default) asks the run to stop
after its current step, with a checkpoint of that step; the driver then exits with `exit_codes.PREEMPTED`.

The handler only records the request: here (the trainer may run in this process) and in the driver's
registry (`failures.request_stop`; the trainer may run in a Ray task), from a thread, since a signal
handler must not wait on Ray. The trainer asks `stop_reason()` at its step's checkpoint point and at its
end (`trainer_faults.py`). A second signal gets the signal's default action: the run ends at once.

Schedulers send the signal ahead of a kill (Kubernetes: `terminationGracePeriodSeconds`, SLURM:
`--signal`); the grace period must cover the rest of a step and a checkpoint. Deliver it to the driver
process only: signalled too, Ray's processes would end before the checkpoint is written.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading

from skyrl_megatron.failures import request_stop, stop_requested

logger = logging.getLogger(__name__)

_received: str | None = None  # the request, in the process that got the signal


class PreemptionHandler:
    """The installed handler of one signal (`install`), put back by `uninstall`."""

    def __init__(self, name: str):
        self.name = name
        self.signum = getattr(signal, name)
        self._previous = None

    def install(self) -> bool:
        """Handle the signal from now on; False where that is impossible (not the main thread)."""
        try:
            self._previous = signal.signal(self.signum, self._handle)
        except ValueError:
            logger.warning("%s is not handled: signal handlers can only be set from the main thread", self.name)
            return False
        return True

    def uninstall(self) -> None:
        global _received
        if self._previous is not None:
            signal.signal(self.signum, self._previous)
            self._previous = None
        _received = None

    def _handle(self, signum, frame) -> None:
        global _received
        if _received is not None:  # asked twice: the signal's default action, now
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
            return
        _received = f"{self.name} received by the driver"
        print(f"skyrl-megatron: {self.name}: finishing the current step, then saving a checkpoint and exiting "
              f"(send {self.name} again to stop at once)", file=sys.stderr, flush=True)
        threading.Thread(target=_forward, args=(_received,), name="preemption-request", daemon=True).start()


def _forward(reason: str) -> None:
    try:
        request_stop(reason)
    except Exception as exc:  # noqa: BLE001 - a trainer in this process still sees the request
        logger.warning("could not pass the stop request to the trainer's registry: %s", exc)


def install(name: str | None) -> PreemptionHandler | None:
    """Handle `name` (a `config.PREEMPTION_SIGNALS` name) from now on; None for null or where impossible."""
    if name is None:
        return None
    handler = PreemptionHandler(name)
    return handler if handler.install() else None


def stop_reason() -> str | None:
    """Why the run should stop after its current step (a preemption signal), or None."""
    return _received or stop_requested()
