"""The judging steps of the pipeline, pure: each returns its product or raises StepFailure.

A StepFailure carries the status the candidate ends with and the error text it gets; the
pipeline stops at the first one and builds the verdict from it. Which step runs first sets
the priority when several apply: format > library > stage > compile > timeout/runtime >
verification. InternalError is the other way out: the benchmarker itself failed, never the
candidate, so the candidate gets no verdict and is tried again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hpcrl_benchmarker import checks, protocol, verify
from hpcrl_benchmarker.extract import ExtractError, extract
from hpcrl_benchmarker.verdict import timing_stats
from hpcrl_common.messages import Status, Timing
from hpcrl_common.stages import Stage
from hpcrl_common.task import TaskSpec

# Statuses that say the rules were broken: final wherever they are found.
RULES_BROKEN = frozenset({"format_violation", "library_violation", "stage_violation"})
# The kernel's own lines after preprocessing (headers excluded); real kernels are far below.
PREPROCESSED_LIMIT = 2 * 1024 * 1024


class StepFailure(Exception):
    """A step's verdict on the candidate: the status it ends with, and why."""

    def __init__(self, status: Status, error: str) -> None:
        super().__init__(f"{status}: {error}")
        self.status: Status = status
        self.error = error


class InternalError(RuntimeError):
    """The benchmarker itself failed (not the candidate's fault): retry elsewhere."""


@dataclass(frozen=True)
class Phase:
    """The calls of one phase of a harness run, numbered from the phase's first job, and how
    the process ended if it ended before the phase was complete."""

    frames: list[protocol.Frame]
    failure: StepFailure | None


@dataclass(frozen=True)
class Measurement:
    timing: Timing
    gflops: float


# --- extract, check --------------------------------------------------------------------------


def extract_kernel(completion: str, task: TaskSpec) -> str:
    """The translation unit that defines the task's function."""
    try:
        return extract(completion, task.signature).code
    except ExtractError as exc:
        raise StepFailure("format_violation", str(exc)) from None


def check_source(code: str, techniques: set[str], policy: Stage) -> None:
    """The rules as the code is written: no library calls, no technique the stage forbids."""
    _obey(checks.source_violations(code), techniques, policy)


def within_limit(preprocessed: str) -> str:
    """The kernel's preprocessed lines, if they are few enough for the checks to read."""
    if len(preprocessed) > PREPROCESSED_LIMIT:
        # The checks read every character of it (~1 s per MB, outside the sandbox's
        # limits): a macro bomb must not buy itself a minute of this process.
        raise StepFailure(
            "compile_error",
            (
                f"the kernel expands to {len(preprocessed) / 2**20:.1f} MiB after "
                f"preprocessing, above the {PREPROCESSED_LIMIT // 2**20} MiB limit"
            ),
        )
    return preprocessed


def compiled_techniques(preprocessed: str, listing: checks.ObjectListing | None) -> set[str]:
    """Techniques that only the preprocessed lines or the object show."""
    found = checks.detect_techniques("", preprocessed)
    return found | (checks.object_techniques(listing.undefined) if listing else set())


def check_compiled(
    preprocessed: str,
    listing: checks.ObjectListing | None,
    error: str,
    techniques: set[str],
    policy: Stage,
    *,
    function: str,
    runtime_symbols: frozenset[str],
) -> None:
    """The rules again on what the compiler made of the code (macros expanded, the object's
    symbols and sections), then the compiler's own verdict."""
    reasons = checks.source_violations("", preprocessed)
    if listing is not None:
        if listing.unreadable:
            reasons.append(
                f"the object's symbol table could not be read: {listing.unreadable[0][:200]}"
            )
        reasons += checks.object_violations(
            listing.undefined,
            listing.defined,
            checks.parse_sections(listing.readelf),
            function=function,
            runtime_symbols=runtime_symbols,
        )
        reasons += checks.layout_violations(listing.readelf)
    _obey(reasons, techniques, policy)
    if error:
        raise StepFailure("compile_error", error)


def _obey(reasons: list[str], techniques: set[str], policy: Stage) -> None:
    if reasons:
        raise StepFailure("library_violation", "; ".join(reasons))
    if broken := policy.violations(techniques):
        raise StepFailure(
            "stage_violation",
            f"stage {policy.number} forbids {', '.join(broken)}, which the code uses",
        )


# --- verify ----------------------------------------------------------------------------------


def frame_message(frame: protocol.Frame, expected: verify.Expected, tolerance: float) -> str:
    """'' when the frame's output is right, else why not."""
    names = expected.names
    if frame.flags & protocol.FLAG_INPUTS_MODIFIED:
        return f"the kernel modified its inputs {names.inputs}"
    if frame.flags & protocol.FLAG_OUTSIDE_WRITTEN:
        return (
            f"the kernel wrote outside its arrays (just before or after {names.arrays}: "
            "out-of-bounds writes)"
        )
    if frame.flags & protocol.FLAG_CHANGED_AFTER_RETURN:
        return f"{names.output} was still being written after the kernel returned"
    if frame.flags & protocol.FLAG_PARALLEL_LEFT_OPEN:
        return (
            "the kernel returned with a parallel region still open (threads left "
            "running after the call)"
        )
    if frame.stray_threads:
        return (
            f"{frame.stray_threads} thread(s) that the kernel started were still running "
            "after the call returned (beyond the main thread and OpenMP's thread pool)"
        )
    return verify.check_expected(frame.output, expected, tolerance)


class EarlyVerdict:
    """Watches the verification phase's calls as they arrive and checks each one; ends the
    run as soon as its outcome is known: a wrong result at the reward size (the kernel is
    then never timed) or, with generalisation penalised, a wrong one at any size."""

    def __init__(self, task: TaskSpec, expected: Sequence[verify.Expected], sizes: int) -> None:
        self.tolerance = task.verification.rel_tolerance
        self.penalize = task.penalize_generalization
        self.expected = expected
        self.sizes = sizes
        self.messages: dict[int, str] = {}

    def __call__(self, frame: protocol.Frame) -> bool:
        self.messages[frame.job] = self.message(frame)
        if frame.job == 0:
            return bool(self.messages[0])  # the verdict is a verification error: stop
        return frame.job == self.sizes - 1 and self.penalize and any(self.messages.values())

    def message(self, frame: protocol.Frame) -> str:
        # A frame that arrived in the same read as the one that stopped the run was not
        # watched: it is checked here.
        if frame.job in self.messages:
            return self.messages[frame.job]
        return frame_message(frame, self.expected[frame.job], self.tolerance)


def check_clocks(frames: list[protocol.Frame]) -> None:
    """Every call's reported clocks fit the host kernel's stamps of its messages."""
    for frame in frames:
        if problem := frame.timing_problem():
            raise StepFailure("verification_error", f"the timing was tampered with: {problem}")


def verification_problems(jobs: list[protocol.Job], phase: Phase, watch: EarlyVerdict) -> list[str]:
    """What went wrong at the extra sizes; a failure at the reward size ends the candidate."""
    if not phase.frames:
        assert phase.failure is not None
        raise phase.failure
    messages = [watch.message(frame) for frame in phase.frames]
    if messages[0]:
        raise StepFailure(
            "verification_error", f"wrong result at {sizes_text(jobs[0].sizes)}: {messages[0]}"
        )
    problems = [
        f"{sizes_text(jobs[f.job].sizes)}: {m}"
        for f, m in zip(phase.frames, messages, strict=True)
        if m
    ]
    if phase.failure is not None:
        if phase.failure.status in RULES_BROKEN:
            # A rule broken at any size (a thread at a stage without OpenMP, work outside a
            # call) is the verdict, not a matter of generalisation.
            raise phase.failure
        problems.append(f"{phase.failure.status}: {phase.failure.error}")
    return problems


def generalization_note(task: TaskSpec, problems: list[str]) -> str:
    """The note a successful verdict carries ('' if none); fatal when the task penalises it."""
    if not problems:
        return ""
    text = "does not generalise to other sizes: " + "; ".join(problems)
    if task.penalize_generalization:
        raise StepFailure("verification_error", text)
    return text


# --- time ------------------------------------------------------------------------------------


_PHASES = {"w": "warm-up", "t": "timed", "v": "final verification"}


def measure(
    task: TaskSpec,
    jobs: list[protocol.Job],
    phase: Phase,
    expected: Sequence[verify.Expected],
    peak_gflops: float,
) -> Measurement:
    """The timing phase's verdict: every run right, clocks untampered, a possible speed."""
    if phase.failure is not None:
        raise phase.failure
    tolerance = task.verification.rel_tolerance
    for frame in phase.frames:
        if message := frame_message(frame, expected[frame.job], tolerance):
            raise StepFailure(
                "verification_error",
                f"wrong result in the {_PHASES[jobs[frame.job].kind]} run: {message}",
            )
    check_clocks(phase.frames)
    runs = [f.effective_seconds() for f in phase.frames if jobs[f.job].kind == "t"]
    if not all(protocol.is_finite_positive(r) for r in runs):
        raise StepFailure("runtime_error", f"the harness's clock reported impossible times {runs}")
    timing = timing_stats(runs)
    gflops = task.flop_count(task.sizes.reward) / timing.mean_s / 1e9
    if gflops > peak_gflops:
        raise StepFailure(
            "verification_error",
            (
                f"measured {gflops:.1f} GFLOPS, above this host's theoretical peak of "
                f"{peak_gflops:.1f} GFLOPS; such a measurement cannot be genuine"
            ),
        )
    return Measurement(timing, gflops)


def steadiest(attempts: Sequence[Measurement], max_cv: float) -> Measurement:
    """The timing attempt to keep: the one whose timed runs agree best (lowest CV; the
    earliest on a tie), with the number of attempts and whether it is still noisy."""
    best = min(attempts, key=lambda attempt: attempt.timing.cv)
    timing = Timing(
        **{**best.timing.model_dump(), "attempts": len(attempts), "noisy": best.timing.cv > max_cv}
    )
    return Measurement(timing, best.gflops)


def sizes_text(sizes: Mapping[str, int]) -> str:
    return "x".join(str(v) for v in sizes.values())
