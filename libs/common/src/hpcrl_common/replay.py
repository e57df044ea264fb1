"""The replay file: a policy's taught examples as token ids, one JSON object a line.

The bootstrap writes it beside the policy it trains (its SFT examples exactly as encoded);
the learner reads it for its supervised replay term (``learner.replay_coef``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

REPLAY_FILE = "replay.jsonl"


def replay_line(
    prompt_ids: Sequence[int], completion_ids: Sequence[int], *, stage: int, mode: str
) -> str:
    """One example's line (with its newline): the ids of the rendered prompt (generation
    prompt included) and of the completion (its end-of-turn token included)."""
    row = {
        "mode": mode,
        "stage": stage,
        "prompt_ids": list(prompt_ids),
        "completion_ids": list(completion_ids),
    }
    return json.dumps(row, separators=(",", ":")) + "\n"
