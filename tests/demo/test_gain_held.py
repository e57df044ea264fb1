"""The demo's check that a run keeps its early gain: which version it evaluates as "after
four iterations", and what it prints from the evaluation's comparisons."""

from __future__ import annotations

import sys
import time

from hpcrl_common.checkpoints import CheckpointStore
from hpcrl_scheduler.store import Store
from tests.support.scripts import ROOT, load_script

sys.path.insert(0, str(ROOT / "deploy" / "local"))  # demo.py imports its neighbours
demo = load_script("deploy/local/demo.py", "demo_script")


def commit_version(store: CheckpointStore, version: int) -> None:
    staging = store.staging_dir(version)
    (staging / "model.safetensors").write_bytes(b"weights of v%d" % version)
    store.commit(staging, version, version - 1, "full")


def close_iteration(store: Store, iteration: int, groups: int = 2) -> None:
    for ordinal in range(groups):
        gid = f"g{iteration}-{ordinal}"
        store.plan_group(
            gid,
            iteration=iteration,
            ordinal=ordinal,
            parent_id="seed",
            mode="improve",
            target_stage=1,
            group_size=2,
            prompt=[],
        )
        store.mark_closed(
            gid,
            at=time.time(),
            reason="complete",
            outcome="sent",
            host_class="x",
            excluded=0,
            reward_mean=None,
            reward_max=None,
        )


def test_the_version_after_four_iterations_is_the_newest_committed_when_they_closed(tmp_path):
    db, checkpoints = tmp_path / "scheduler.db", CheckpointStore(tmp_path / "ckpt")
    store = Store(db)
    assert demo.version_after_iterations(db, checkpoints.root, 4) is None  # no run yet
    commit_version(checkpoints, 1)
    for iteration in range(3):
        close_iteration(store, iteration)
    commit_version(checkpoints, 2)
    time.sleep(0.01)
    close_iteration(store, 3)
    assert demo.version_after_iterations(db, checkpoints.root, 4) is None  # run of 4 only
    time.sleep(0.01)
    commit_version(checkpoints, 3)
    close_iteration(store, 4)
    assert demo.version_after_iterations(db, checkpoints.root, 4) == 2


def gain(value: float, low: float, high: float) -> dict[str, float]:
    return {"before": 0.0, "after": value, "gain": value, "low": low, "high": high}


def comparison(after: int, share: dict, gflops: dict, per_prompt: list) -> dict:
    return {
        "before": 0,
        "after": after,
        "metrics": {"share_correct": share, "mean_gflops": gflops},
        "per_prompt": per_prompt,
    }


def test_the_headline_says_whether_the_gain_was_kept_and_which_prompts_lost(capsys):
    lost = {"name": "deepen tiled@2", "metrics": {"share_correct": gain(-0.3, -0.5, -0.1)}}
    unclear = {"name": "seed@1", "metrics": {"share_correct": gain(-0.1, -0.3, 0.1)}}
    middle = comparison(7, gain(0.2, 0.1, 0.3), gain(5.0, 2.0, 8.0), [])
    final = comparison(17, gain(0.25, 0.1, 0.4), gain(3.0, 1.0, 5.0), [lost, unclear])
    demo.print_gain_held(
        {
            "comparison": final,
            "comparisons": [middle, final],
            "metric_labels": {"share_correct": "share correct", "mean_gflops": "mean GFLOPS"},
        }
    )
    out = " ".join(capsys.readouterr().out.split())
    assert "gain after 4 iterations (v7) -> final (v17)" in out
    assert "share correct +0.2 [+0.1, +0.3] -> +0.25 [+0.1, +0.4] kept" in out
    assert "mean GFLOPS +5 [+2, +8] -> +3 [+1, +5] not kept" in out
    assert "below 0): deepen tiled@2" in out and "seed@1" not in out


LABELS = {"share_correct": "share correct", "mean_gflops": "mean GFLOPS"}


def verdict(share: dict, gflops: dict, per_prompt: list | None = None) -> str:
    return " ".join(
        demo.learning_verdict(comparison(17, share, gflops, per_prompt or []), LABELS).split()
    )


def test_the_verdict_calls_a_gain_help_only_when_no_prompt_lost():
    lost = {"name": "improve prefetch@5", "metrics": {"share_correct": gain(-0.6, -0.8, -0.4)}}
    helped = verdict(gain(0.2, 0.1, 0.3), gain(4.0, -1.0, 9.0))
    assert "learning helped" in helped and "share correct +0.2 [+0.1, +0.3] rose" in helped
    assert "mean GFLOPS" not in helped  # its CI contains 0: not counted as a rise
    mixed = verdict(gain(0.2, 0.1, 0.3), gain(4.0, 1.0, 9.0), [lost])
    assert mixed.startswith("[yellow]mixed:[/]") and "1 prompt(s) lost share correct" in mixed
    assert "improve prefetch@5" in mixed and "helped" not in mixed


def test_the_verdict_does_not_read_a_gain_into_intervals_that_contain_zero():
    """The Zen 5 demo of 2026-12-06: mean reward +8.9 [+2.3, +15.3] was called "learning
    helped" while share correct and mean GFLOPS held still and three prompts fell."""
    lost = {"name": "deepen omp@4->5", "metrics": {"share_correct": gain(-0.5, -0.7, -0.2)}}
    flat = verdict(gain(0.016, -0.05, 0.09), gain(-0.49, -3.2, 2.3), [lost])
    assert "no clear gain, some loss" in flat and "deepen omp@4->5" in flat
    assert "helped" not in flat
    assert "no clear change" in verdict(gain(0.016, -0.05, 0.09), gain(-0.49, -3.2, 2.3))
    worse = verdict(gain(-0.1, -0.2, -0.05), gain(3.0, 1.0, 5.0))
    assert "worse" in worse and "share correct -0.1 [-0.2, -0.05] fell" in worse
