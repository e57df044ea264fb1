"""A result's rollout is the generator's: tokens are trained only as the generator sent them.

A benchmarker passes each candidate's ``rollout`` (prompt and completion token ids, sampling
log-probs, policy version) through to its result and reports the hash of the text it judged
(``completion_sha256``); both are written by the benchmarker, so on their own they tie
nothing to what the generator sent. The generator therefore commits to its candidates: with
each group it publishes a ``candidate-commitment/2`` (``candidate-commitments``, a queue only
the generator role may write) holding, per candidate index, the hash of the rollout it sent
(:func:`hpcrl_common.messages.rollout_sha256`), and the text with its hash (``text_sha256``,
checked on decode). The text stays in the store with the commitment until the group closes:
a group winner's second measurement compiles it (:mod:`hpcrl_scheduler.confirm`), so a
benchmarker cannot have a fast kernel from elsewhere, reported against a slow candidate,
confirmed. A ``candidate-commitment/1`` (hashes only, a generator of the release before) is
read and filed without text. The scheduler files a result that carries a rollout only when:

* the rollout's hash is one the generator committed to for that candidate id (a request
  sampled again after a generator's crash commits again under a new id: each is kept), and
* the text the benchmarker says it judged is that candidate's text (a result without
  ``completion_sha256``, from an older benchmarker, is checked on its rollout alone; the
  learner's ``require_judged_text`` decides about it as before).

Otherwise it is ``mismatch``: dead-lettered with the reason, counted
(``hpcrl_scheduler_results_ignored_total{reason="rollout_mismatch"}``), not filed, so its
slot stays open for a genuine result (another replica's) or the group's deadline, as for a
result above its host's peak.

Ordering: the generator publishes a group's commitment before its candidates, on one
channel, but the two queues are consumed apart, so a result may come first. It is then
*held* (``held_results``, stored before its delivery is acked; acked as ``Ignore`` so that
another result under the same id is still handled) and decided when the commitment comes:
filed, or dead-lettered through the outbox. A held result whose commitment has not come
within ``scheduler.commitment_wait_s`` is dead-lettered as ``no_commitment``
(``require_commitments``, the default) or filed unchecked (``require_commitments = false``:
generators of an older release, which commit to nothing, during a rolling upgrade; a
commitment that does come is enforced either way). A held result does not count toward its
group: a group whose results wait closes when they are decided, or at its deadline.

Results without a rollout (confirmations, benchmarkers' own re-measurements) carry no tokens
and are not checked. All of it lives in the store (SQLite), so a kill -9 between a commitment
and its result loses neither; the wait restarts with the scheduler, like group deadlines.
"""

from __future__ import annotations

from typing import Literal

from hpcrl_common.messages import BenchResult, rollout_sha256

Verdict = Literal["match", "mismatch", "unknown"]


def check(result: BenchResult, committed: list[tuple[str, str]]) -> tuple[Verdict, str]:
    """Whether ``result``'s rollout (set) is one of ``committed`` ((rollout_sha256,
    completion_sha256) pairs of its candidate id), and why not."""
    if not committed:
        return "unknown", "no commitment of the generator for this candidate yet"
    assert result.rollout is not None
    digest = rollout_sha256(result.rollout)
    texts = [text for rollout, text in committed if rollout == digest]
    if not texts:
        return "mismatch", (
            f"its rollout ({len(result.rollout.completion_token_ids)} completion tokens, "
            f"sha256 {digest[:16]}…) is not the one the generator committed to for "
            f"{result.id}"
        )
    judged = result.completion_sha256
    if judged is not None and judged not in texts:
        return "mismatch", (
            f"the text it says it judged (sha256 {judged[:16]}…) is not the text the "
            f"generator sent as {result.id}"
        )
    return "match", ""
