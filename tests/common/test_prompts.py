import pytest

from hpcrl_common.prompts import Templates, build_prompt, truncate_error
from hpcrl_common.stages import LAST_STAGE
from hpcrl_common.task import load_task
from hpcrl_scheduler.scheduler import task_seed

TASK = load_task("matmul")
PARENT = task_seed(TASK)


def user_text(**kwargs) -> str:
    messages = build_prompt(TASK, **kwargs)
    assert [m.role for m in messages] == ["system", "user"]
    return messages[1].content


def test_every_prompt_states_task_signature_sizes_and_stage_rules():
    text = user_text(target_stage=1, mode="seed", parent_source=None, error=None, isa="avx512")
    assert TASK.signature in text
    assert "M=256, N=256, K=256" in text
    assert "255" in text  # a non-multiple verification size
    assert "Stage 1" in text
    assert "Allowed techniques: register blocking." in text
    forbidden = text.split("Forbidden:")[1]
    for word in ("SIMD", "OpenMP", "prefetch"):
        assert word in forbidden


def test_system_message_names_the_isa_and_asks_for_one_c_block():
    for isa, name in (("avx512", "AVX-512"), ("avx2", "AVX2")):
        system = build_prompt(
            TASK, target_stage=3, mode="seed", parent_source=None, error=None, isa=isa
        )[0].content
        assert name in system
        assert "```c" in system
    text = user_text(target_stage=3, mode="seed", parent_source=None, error=None, isa="avx2")
    assert "_mm256" in text and "_mm512" not in text


def test_deepen_names_the_newly_allowed_technique_and_shows_the_parent():
    text = user_text(target_stage=3, mode="deepen", parent_source=PARENT, error=None, isa="avx512")
    instruction = text.split("Forbidden:")[1]
    assert "faster using AVX-512 SIMD" in instruction
    assert "Forbidden: OpenMP, prefetch instructions." in text
    assert "```c\n" + PARENT.strip() + "\n```" in text


def test_last_stage_deepen_forbids_nothing():
    text = user_text(
        target_stage=LAST_STAGE, mode="deepen", parent_source=PARENT, error=None, isa="avx512"
    )
    assert "Forbidden: nothing." in text


def test_improve_and_repair_differ_and_repair_shows_the_error():
    improve = user_text(
        target_stage=2, mode="improve", parent_source=PARENT, error=None, isa="avx512"
    )
    repair = user_text(
        target_stage=2,
        mode="repair",
        parent_source=PARENT,
        error="compile error: x.c:3:5: error: expected ';'",
        isa="avx512",
    )
    assert "faster variant" in improve and "failed" not in improve
    assert "x.c:3:5: error: expected ';'" in repair and "Fix it" in repair
    assert "cache blocking" in improve


def test_long_errors_are_cut_in_the_middle():
    error = "\n".join(f"x.c:{i}: error: problem number {i}" for i in range(500))
    text = user_text(target_stage=1, mode="repair", parent_source=PARENT, error=error, isa="avx512")
    assert "problem number 0" in text and "problem number 499" in text
    assert "problem number 250" not in text
    assert "more lines" in text
    assert len(truncate_error(error)) < 1100


def test_non_seed_modes_need_a_parent_and_bad_values_are_refused():
    with pytest.raises(ValueError):
        build_prompt(
            TASK, target_stage=1, mode="improve", parent_source=None, error=None, isa="avx512"
        )
    with pytest.raises(ValueError):
        build_prompt(TASK, target_stage=1, mode="seed", parent_source=None, error=None, isa="sse")
    with pytest.raises(ValueError):
        build_prompt(TASK, target_stage=7, mode="seed", parent_source=None, error=None, isa="avx2")


def test_templates_are_data(tmp_path):
    custom = tmp_path / "t.toml"
    custom.write_text(
        'system = "SYS $isa_name"\nuser = "U $stage $instruction"\n'
        '[modes]\nseed = "S"\ndeepen = "D $parent"\nimprove = "I"\n'
        'repair = "R $error"\n'
    )
    templates = Templates.parse(custom.read_text())
    messages = build_prompt(
        TASK,
        target_stage=2,
        mode="repair",
        parent_source="int x;",
        error="boom",
        isa="avx2",
        templates=templates,
    )
    assert messages[0].content == "SYS AVX2"
    assert messages[1].content == "U 2 R boom"
    with pytest.raises(ValueError, match="repair"):
        Templates.parse(
            'system = "a"\nuser = "b"\n[modes]\nseed = "s"\ndeepen = "d"\nimprove = "i"\n'
        )


def test_prompts_stay_compact():
    text = user_text(target_stage=4, mode="improve", parent_source=PARENT, error=None, isa="avx512")
    assert len(text) < 2000
