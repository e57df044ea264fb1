import pytest

from hpcrl_common.stages import LAST_STAGE
from hpcrl_scheduler.selection import (
    Program,
    Ratios,
    allocate,
    candidates_of_stage,
    select,
)

from .helpers import program

SEED = Program(id="seed", stage=1, status="success", source="void seed(){}")


def modes(nodes):
    return [(n.mode, n.parent.id, n.target_stage) for n in nodes]


def test_the_seed_alone_when_the_pool_is_empty():
    assert modes(select([], SEED, iteration=0, budget=10, ratios=Ratios(), seed=1)) == [
        ("seed", "seed", 1)
    ]


def test_unbounded_shares_top_40_middle_30_and_all_failures():
    pool = [program(f"p{i}", gflops=float(i)) for i in range(10)]
    pool += [program("f1", status="compile_error"), program("f2", status="verification_error")]
    nodes = select(pool, SEED, iteration=1, budget=0, ratios=Ratios(), seed=0)
    got = modes(nodes)
    assert got[0] == ("seed", "seed", 1)
    deepen = [p for m, p, s in got if m == "deepen"]
    improve = [p for m, p, s in got if m == "improve"]
    repair = [p for m, p, s in got if m == "repair"]
    assert deepen == ["p9", "p8", "p7", "p6"]  # best first
    assert improve == ["p5", "p4", "p3"]  # the middle; p0..p2 are not expanded
    assert repair == ["f2", "f1"]  # most-progressed failure first
    assert all(s == 2 for m, _, s in got if m == "deepen")
    assert all(s == 1 for m, _, s in got if m in ("improve", "repair"))


def test_budget_is_split_by_the_ratios():
    pool = [program(f"p{i:02d}", gflops=float(i)) for i in range(30)]
    pool += [program(f"f{i:02d}", status="compile_error") for i in range(30)]
    nodes = select(pool, SEED, iteration=1, budget=10, ratios=Ratios(), seed=0)
    counts = {m: sum(n.mode == m for n in nodes) for m in ("seed", "deepen", "improve", "repair")}
    assert counts == {"seed": 1, "deepen": 4, "improve": 3, "repair": 3}


def test_ratios_are_configurable():
    pool = [program(f"p{i:02d}", gflops=float(i)) for i in range(30)]
    pool += [program(f"f{i:02d}", status="compile_error") for i in range(30)]
    nodes = select(pool, SEED, iteration=1, budget=10, ratios=Ratios(0.8, 0.2, 0.0), seed=0)
    counts = {m: sum(n.mode == m for n in nodes) for m in ("deepen", "improve", "repair")}
    assert counts["repair"] == 0
    assert counts["deepen"] + counts["improve"] == 10
    assert counts["deepen"] >= 8 - 1


def test_budget_is_split_across_stages_and_unused_shares_move():
    pool = [program(f"a{i}", stage=1, gflops=float(i)) for i in range(20)]
    pool += [program("b0", stage=3, gflops=5.0)]  # stage 3 can use one node only
    nodes = select(pool, SEED, iteration=2, budget=8, ratios=Ratios(), seed=0)
    assert len(nodes) == 1 + 8
    by_stage = {}
    for node in nodes[1:]:
        by_stage[node.parent.stage] = by_stage.get(node.parent.stage, 0) + 1
    assert by_stage == {1: 7, 3: 1}


def test_all_failed_stage_is_repaired_with_the_whole_share():
    pool = [program(f"f{i}", stage=2, status="compile_error") for i in range(6)]
    pool.append(program("v", stage=2, status="verification_error"))
    nodes = select(pool, SEED, iteration=3, budget=4, ratios=Ratios(), seed=0)
    assert [n.mode for n in nodes] == ["seed", "repair", "repair", "repair", "repair"]
    assert nodes[1].parent.id == "v"
    assert all(n.target_stage == 2 for n in nodes[1:])


def test_failures_without_source_cannot_be_repaired():
    lost = Program(id="x", stage=1, status="format_violation", source=None)
    assert select([lost], SEED, iteration=1, budget=5, ratios=Ratios(), seed=0) == select(
        [], SEED, iteration=1, budget=5, ratios=Ratios(), seed=0
    )


def test_successes_without_source_are_never_parents():
    """With benchmarker.include_source = false every result lacks its source; selecting one
    used to make every later tick raise while the scheduler reported itself healthy."""
    hidden = Program(id="h", stage=1, status="success", gflops=50.0, source=None)
    pool = [hidden, program("shown", gflops=10.0)]
    nodes = select(pool, SEED, iteration=1, budget=5, ratios=Ratios(), seed=0)
    assert [n.parent.id for n in nodes] == ["seed", "shown"]
    assert select([hidden], SEED, iteration=1, budget=5, ratios=Ratios(), seed=0) == select(
        [], SEED, iteration=1, budget=5, ratios=Ratios(), seed=0
    )


def test_the_last_stage_deepens_into_itself():
    pool = [program("top", stage=LAST_STAGE, gflops=100.0)]
    nodes = select(pool, SEED, iteration=4, budget=3, ratios=Ratios(), seed=0)
    assert modes(nodes)[1] == ("deepen", "top", LAST_STAGE)


def test_ties_are_broken_by_seed_not_by_input_order():
    pool = [program(f"t{i}", gflops=7.0) for i in range(10)]

    def picked(seed, order):
        nodes = select(order, SEED, iteration=1, budget=3, ratios=Ratios(), seed=seed)
        return [n.parent.id for n in nodes[1:]]

    assert picked(1, pool) == picked(1, list(reversed(pool)))
    seeds = {tuple(picked(s, pool)) for s in range(8)}
    assert len(seeds) > 1  # a different seed can pick differently among equals


def test_duplicates_are_one_node():
    same = "void k(){int a;}"
    pool = [program("a", gflops=5.0, source=same), program("b", gflops=4.0, source=same + " ")]
    nodes = select(pool, SEED, iteration=1, budget=0, ratios=Ratios(), seed=0)
    assert [n.parent.id for n in nodes[1:]] == ["a"]


def test_small_stages_round_up_so_the_best_is_deepened():
    lists = candidates_of_stage([program("only", gflops=1.0)], Ratios(), 0, 1)
    assert [p.id for p in lists["deepen"]] == ["only"]
    assert lists["improve"] == []


def test_allocate_respects_caps_and_total():
    assert allocate(10, [0.4, 0.3, 0.3], [100, 100, 100], [0, 1, 2]) == [4, 3, 3]
    assert allocate(10, [0.4, 0.3, 0.3], [1, 100, 0], [0, 1, 2]) == [1, 9, 0]
    assert allocate(10, [1, 1], [2, 3], [0, 1]) == [2, 3]
    assert sum(allocate(7, [0.4, 0.3, 0.3], [9, 9, 9], [2, 0, 1])) == 7


def test_bad_ratios_are_refused():
    with pytest.raises(ValueError):
        Ratios(0, 0, 0)
    with pytest.raises(ValueError):
        Ratios(-1, 1, 1)
