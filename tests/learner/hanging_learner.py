"""The real `hpcrl-learner` CLI, made to stop dead at one point so a crash test can kill -9 it.

    python tests/learner/hanging_learner.py POINT MARKER serve --config TOML

POINT is where the process stops: ``received`` (a batch is held, nothing trained),
``before_commit`` (the step is trained and the version and learner state are written, not
committed) or ``after_commit`` (committed, nothing acked or announced). There it writes POINT
to the file MARKER and sleeps until it is killed. Everything else is the unchanged service:
only the learner's own methods are wrapped, from outside, in this process.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from hpcrl_common.broker import Delivery
from hpcrl_common.checkpoints import CheckpointStore
from hpcrl_common.messages import RolloutBatch
from hpcrl_learner import cli
from hpcrl_learner.service import Learner

POINTS = ("received", "before_commit", "after_commit")


def stop_here(point: str, marker: Path) -> None:
    marker.write_text(point)
    print(f"hanging_learner: reached {point}; waiting to be killed", file=sys.stderr, flush=True)
    while True:
        time.sleep(60)


def install(point: str, marker: Path) -> None:
    if point == "received":
        handle = Learner.handle

        def held(self: Learner, batch: RolloutBatch, delivery: Delivery) -> Any:
            out = handle(self, batch, delivery)
            if any(group.batch_id == batch.id for group, _ in self.pending):
                stop_here(point, marker)
            return out

        Learner.handle = held  # type: ignore[method-assign]
    elif point == "before_commit":
        commit = CheckpointStore.commit

        def uncommitted(self: CheckpointStore, *args: Any, **kwargs: Any) -> Any:
            stop_here(point, marker)
            return commit(self, *args, **kwargs)

        CheckpointStore.commit = uncommitted  # type: ignore[method-assign]
    else:
        step_commit = Learner._commit

        def committed(self: Learner, *args: Any, **kwargs: Any) -> Any:
            info = step_commit(self, *args, **kwargs)
            stop_here(point, marker)
            return info

        Learner._commit = committed  # type: ignore[method-assign]


def main(argv: list[str]) -> int:
    point, marker, *rest = argv
    if point not in POINTS:
        raise SystemExit(f"POINT must be one of {', '.join(POINTS)}, not {point!r}")
    install(point, Path(marker))
    return cli.main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
