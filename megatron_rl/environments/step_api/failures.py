"""Episodes that failed (the user's class raised, or returned the wrong shape, on one row): left out of the
batch, counted in ``rollout/failed_samples``, each kind of failure logged once per run (rank 0, stderr).

A local stand-in until a generic failed-sample helper for every environment exists (issue 31); it is meant to be
replaced by that one (same metric, same behaviour), which is why it is this small.
"""

from __future__ import annotations

import os
import sys

from megatron_rl.config import ConfigError

METRIC = "rollout/failed_samples"


class EveryEpisodeFailed(ConfigError):
    """No episode of a batch finished: the class is broken, not one row (reported as one line, exit code 2)."""


class FailedEpisodes:
    """Counts one batch's failures; remembers across batches which kinds were logged."""

    def __init__(self) -> None:
        self.count = 0
        self.first: str | None = None
        self._logged: set[str] = set()

    def start_batch(self) -> None:
        self.count, self.first = 0, None

    def record(self, message: str) -> None:
        self.count += 1
        self.first = self.first or message
        kind = message.split(": ", 1)[0]  # e.g. "MyEnv.step(response) raised KeyError"
        if kind not in self._logged and os.environ.get("RANK", "0") == "0":
            self._logged.add(kind)
            print(f"megatron_rl: an episode failed and is left out (counted in {METRIC}; logged once): {message}",
                  file=sys.stderr, flush=True)

    def check_some_finished(self, finished: int, what: str) -> None:
        if finished == 0:
            raise EveryEpisodeFailed(f"every episode of {what} failed ({self.count}); the first: {self.first}")
