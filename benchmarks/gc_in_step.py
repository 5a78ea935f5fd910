"""Python's garbage collector in step with the other ranks (peers.py --gc-every).

[Note: collecting in step]
CPython collects when allocations cross a threshold, so each rank pauses at its own moment:
a generation-2 pass over a large model's objects can take milliseconds or more. When the step is
host-bound, the GPU of a paused rank runs dry, and every collective that rank joins next
(tensor parallelism's sequence gathers and FP8 scale agreements, a few per layer) makes its
peers wait: one rank's pause becomes the whole group's. ``CollectInStep`` turns automatic
collection off and collects on every rank at the same step boundary, every ``every`` steps, so
the pauses line up and no rank waits for another's. Cycles still get freed, only on a schedule.
Measured on 4 GPUs under tensor parallelism it changed nothing beyond run-to-run noise
(docs/PERFORMANCE.md, section 6), so it is a benchmark switch that rules the collector out, not
a library feature.
"""

from __future__ import annotations

import gc


class CollectInStep:
    """Automatic garbage collection off while active; ``step()`` (after each optimizer step, on
    every rank) collects every ``every`` steps, generation 1 and younger (cheap: what the steps
    since the last collection made), and a full collection on ``close()``. ``every`` 0 leaves
    Python's collector as it is. A context manager; restores the collector's state on exit."""

    def __init__(self, every: int = 50):
        if every < 0:
            raise ValueError(f"CollectInStep(every={every}): every must be >= 0 steps (0 keeps Python's "
                             "automatic collection)")
        self.every = every
        self.steps = 0
        self._was_enabled = None

    @property
    def active(self) -> bool:
        return self._was_enabled is not None

    def start(self) -> "CollectInStep":
        if self.every and not self.active:
            self._was_enabled = gc.isenabled()
            gc.collect()  # start clean: what model building left behind
            gc.disable()
        return self

    def step(self) -> bool:
        """Count a step; True when this one collected."""
        self.steps += 1
        if self.active and self.steps % self.every == 0:
            gc.collect(1)
            return True
        return False

    def close(self) -> None:
        if self.active:
            gc.collect()
            if self._was_enabled:
                gc.enable()
            self._was_enabled = None

    def __enter__(self) -> "CollectInStep":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
