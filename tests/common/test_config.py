"""Typed config: TOML + environment overrides, errors that name the key and its source."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import Field

from hpcrl_common.config import (
    RELATED_DEFAULTS,
    RELATIONS,
    ConfigError,
    Section,
    ServiceConfig,
    load_config,
)


class DemoSection(Section):
    concurrency: int = Field(1, ge=1)
    allow_isa: list[str] = []


class DemoConfig(ServiceConfig):
    benchmarker: DemoSection = DemoSection()


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "exp.toml"
    path.write_text(text)
    return path


def test_defaults_without_a_file():
    config = load_config(DemoConfig, None, env={})
    assert config.broker.url.startswith("amqp://") and config.benchmarker.concurrency == 1


def test_file_then_environment_overrides(tmp_path):
    path = write(
        tmp_path,
        "[broker]\nprefetch = 3\n[benchmarker]\nconcurrency = 2\n"
        '[scheduler]\nanything = "is another service\'s business"\n',
    )
    env = {
        "HPCRL__BENCHMARKER__CONCURRENCY": "4",
        "HPCRL__BENCHMARKER__ALLOW_ISA": '["avx2"]',
        "HPCRL__LOGGING__LEVEL": "debug",
        "UNRELATED": "x",
    }
    config = load_config(DemoConfig, path, env=env)
    assert config.broker.prefetch == 3
    assert config.benchmarker.concurrency == 4
    assert config.benchmarker.allow_isa == ["avx2"]
    assert config.logging.level == "debug"


@pytest.mark.parametrize(
    ("toml", "env", "expected"),
    [
        ("[broker]\nprefetch = 0\n", {}, "broker.prefetch: Input should be greater than or equal"),
        ("[broker]\nprefech = 3\n", {}, "broker.prefech: unknown key (value 3) [from file"),
        ("[brokr]\nurl = 'x'\n", {}, "brokr: unknown key"),
        (
            "",
            {"HPCRL__BENCHMARKER__CONCURRENCY": "many"},
            "benchmarker.concurrency: Input should be a valid integer, unable to parse string "
            "as an integer (value 'many') [from environment HPCRL__BENCHMARKER__CONCURRENCY]",
        ),
        ("[logging]\nlevel = 'loud'\n", {}, "logging.level: Input should be"),
    ],
)
def test_errors_name_the_bad_key_and_its_source(tmp_path, toml, env, expected):
    with pytest.raises(ConfigError) as caught:
        load_config(DemoConfig, write(tmp_path, toml), env=env)
    assert expected in str(caught.value)


def test_unreadable_files_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(DemoConfig, tmp_path / "missing.toml", env={})
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_config(DemoConfig, write(tmp_path, "[broker\n"), env={})


# --- keys of different services that must agree ------------------------------------------


def test_a_disagreement_in_the_file_names_both_keys_values_and_sources(tmp_path):
    path = write(
        tmp_path, '[learner]\nmodel_path = "/models/a"\n[generator]\nmodel_path = "/models/b"\n'
    )
    with pytest.raises(ConfigError) as caught:
        load_config(DemoConfig, path, env={})
    assert str(caught.value) == (
        "invalid configuration:\n"
        "  learner.model_path must equal generator.model_path, but learner.model_path = "
        f"'/models/a' [from file {path}] and generator.model_path = '/models/b' "
        f"[from file {path}]: version 0 of the policy the learner trains and the generators "
        "sample"
    )


def test_an_environment_override_can_break_or_mend_an_agreement(tmp_path):
    path = write(
        tmp_path, '[learner]\nmodel_path = "/models/a"\n[generator]\nmodel_path = "/models/a"\n'
    )
    with pytest.raises(ConfigError) as caught:
        load_config(DemoConfig, path, env={"HPCRL__GENERATOR__MODEL_PATH": "/models/b"})
    assert (
        f"learner.model_path = '/models/a' [from file {path}] and generator.model_path = "
        "'/models/b' [from environment HPCRL__GENERATOR__MODEL_PATH]"
    ) in str(caught.value)
    mended = {
        "HPCRL__GENERATOR__MODEL_PATH": "/models/b",
        "HPCRL__LEARNER__MODEL_PATH": "/models/b",
    }
    assert load_config(DemoConfig, path, env=mended).benchmarker.concurrency == 1


def test_agreeing_keys_load_whichever_service_reads_them(tmp_path):
    from hpcrl_generator.config import GeneratorConfig
    from hpcrl_learner.config import LearnerConfig
    from hpcrl_scheduler.config import SchedulerConfig

    # Values are compared as their type reads them: "./m" is the path "m", "8" the number 8.
    path = write(
        tmp_path,
        '[learner]\nmodel_path = "./m"\ncheckpoint_dir = "ck"\n'
        "groups_per_step = 8\n"
        '[generator]\nmodel_path = "m"\ncheckpoint_dir = "ck/"\n'
        "[scheduler]\n",
    )
    env = {"HPCRL__SCHEDULER__INITIAL_GROUPS_PER_STEP": "8"}
    for model in (DemoConfig, ServiceConfig, GeneratorConfig, LearnerConfig, SchedulerConfig):
        load_config(model, path, env=env)


def test_an_absent_key_counts_with_its_default(tmp_path):
    # The learner would train models/base while the generators sample /models/b.
    path = write(
        tmp_path, '[learner]\nlearning_rate = 1e-6\n[generator]\nmodel_path = "/models/b"\n'
    )
    with pytest.raises(
        ConfigError,
        match=r"learner\.model_path = 'models/base' \[default\] and "
        r"generator\.model_path = '/models/b' \[from file",
    ):
        load_config(DemoConfig, path, env={})
    # The defaults agree with each other, so sections that set neither key load.
    load_config(
        DemoConfig, write(tmp_path, "[scheduler]\niterations = 2\n[learner]\nbeta = 0.0\n"), env={}
    )
    path = write(tmp_path, "[scheduler]\niterations = 2\n[learner]\ngroups_per_step = 8\n")
    with pytest.raises(ConfigError) as caught:
        load_config(DemoConfig, path, env={})
    assert (
        "scheduler.initial_groups_per_step = 4 [default] and learner.groups_per_step = 8 [from file"
    ) in str(caught.value)


def test_what_is_not_compared(tmp_path):
    # A section absent from file and environment describes no such service.
    load_config(DemoConfig, write(tmp_path, '[generator]\nmodel_path = "/models/b"\n'), env={})
    load_config(DemoConfig, write(tmp_path, "[learner]\ngroups_per_step = 8\n"), env={})
    # A required key left out is its own service's error, not a disagreement.
    load_config(DemoConfig, write(tmp_path, '[learner]\nmodel_path = "/m"\n[generator]\n'), env={})
    # An unset generator.checkpoint_dir serves version 0 only: nothing to compare.
    load_config(
        DemoConfig,
        write(
            tmp_path, '[learner]\ncheckpoint_dir = "/ck"\n[generator]\nmodel_path = "models/base"\n'
        ),
        env={},
    )
    # A value of the wrong type is reported by the service that owns it.
    load_config(
        DemoConfig,
        write(tmp_path, "[learner]\n[scheduler]\n"),
        env={"HPCRL__LEARNER__GROUPS_PER_STEP": "many"},
    )


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        (
            '[learner]\ncheckpoint_dir = "/ck/a"\n[generator]\nmodel_path = "models/base"\n'
            'checkpoint_dir = "/ck/b"\n',
            "learner.checkpoint_dir must equal generator.checkpoint_dir, but "
            "learner.checkpoint_dir = '/ck/a'",
        ),
        (
            "[scheduler]\nmax_staleness = 3\ninitial_groups_per_step = 4\n"
            "[learner]\nmax_staleness = 2\n",
            "scheduler.max_staleness must be at most learner.max_staleness, but "
            "scheduler.max_staleness = 3 [from file",
        ),
        (
            '[generator]\nmodel_path = "models/base"\nmax_model_len = 8192\n'
            "[learner]\nmax_sequence_tokens = 4096\n",
            "generator.max_model_len must be at most learner.max_sequence_tokens",
        ),
        (
            '[generator]\nmodel_path = "models/base"\n[learner.lora]\nenabled = true\n',
            "learner.lora.enabled = true requires generator.enable_lora = true, but "
            "learner.lora.enabled = true [from file",
        ),
    ],
)
def test_each_kind_of_relation(tmp_path, toml, expected):
    with pytest.raises(ConfigError) as caught:
        load_config(DemoConfig, write(tmp_path, toml), env={})
    assert expected in str(caught.value)


def test_disagreements_are_reported_with_the_section_errors(tmp_path):
    path = write(
        tmp_path,
        '[benchmarker]\nconcurrency = 0\n[learner]\nmodel_path = "/a"\n'
        '[generator]\nmodel_path = "/b"\n',
    )
    with pytest.raises(ConfigError) as caught:
        load_config(DemoConfig, path, env={})
    lines = str(caught.value).splitlines()
    assert lines[1].startswith("  benchmarker.concurrency: Input should be greater")
    assert lines[2].startswith("  learner.model_path must equal generator.model_path")


def test_the_relation_table_matches_the_sections():
    from hpcrl_generator.config import GeneratorSection
    from hpcrl_learner.config import LearnerSettings
    from hpcrl_scheduler.config import SchedulerSection

    sections = {
        "generator": GeneratorSection,
        "learner": LearnerSettings,
        "scheduler": SchedulerSection,
    }
    keys = {key for relation in RELATIONS for key in (relation.left, relation.right)}
    assert set(RELATED_DEFAULTS) <= keys
    for relation in RELATIONS:
        assert relation.left.split(".")[0] != relation.right.split(".")[0]
    for key in keys:
        section, *path, name = key.split(".")
        model = sections[section]
        for part in path:
            model = model.model_fields[part].annotation
        field = model.model_fields[name]
        if key in RELATED_DEFAULTS:
            assert field.get_default(call_default_factory=True) == RELATED_DEFAULTS[key], key
        else:
            assert field.is_required(), f"{key}: not required, so RELATED_DEFAULTS needs it"


def test_the_defaults_agree(tmp_path):
    # Every section present, only the required key set: the defaults satisfy every relation.
    path = write(tmp_path, '[scheduler]\n[generator]\nmodel_path = "models/base"\n[learner]\n')
    load_config(ServiceConfig, path, env={})


@pytest.mark.parametrize("service", ["generator", "learner", "scheduler", "common"])
def test_every_shipped_config_loads(service):
    from hpcrl_generator.config import GeneratorConfig
    from hpcrl_learner.config import LearnerConfig
    from hpcrl_scheduler.config import SchedulerConfig

    model = {
        "generator": GeneratorConfig,
        "learner": LearnerConfig,
        "scheduler": SchedulerConfig,
        "common": ServiceConfig,
    }[service]
    root = Path(__file__).resolve().parents[2]
    configs = sorted((root / "deploy").rglob("*.toml"))
    assert root / "deploy" / "local" / "demo.toml" in configs
    # As the demo runner starts the services: model paths and store replaced by variables.
    runner = {
        "HPCRL__GENERATOR__MODEL_PATH": "/p",
        "HPCRL__LEARNER__MODEL_PATH": "/p",
        "HPCRL__GENERATOR__CHECKPOINT_DIR": "/ck",
        "HPCRL__LEARNER__CHECKPOINT_DIR": "/ck",
    }
    for config in configs:
        load_config(model, config, env={})
        load_config(model, config, env=runner)


def test_the_scheduler_follows_the_learners_checkpoint_store(tmp_path):
    """scheduler.checkpoint_dir unset: the learner's of the same file (or its default); set
    to another store: refused, naming both keys."""
    from hpcrl_scheduler.config import SchedulerConfig

    shared = write(tmp_path, '[learner]\ncheckpoint_dir = "/shared/ckpt"\n[scheduler]\n')
    assert str(load_config(SchedulerConfig, shared).scheduler.checkpoint_dir) == "/shared/ckpt"
    default = write(tmp_path, "[learner]\ngroups_per_step = 4\n")
    assert str(load_config(SchedulerConfig, default).scheduler.checkpoint_dir) == "data/checkpoints"
    alone = write(tmp_path, "[scheduler]\niterations = 2\n")
    assert load_config(SchedulerConfig, alone).scheduler.checkpoint_dir is None
    other = write(
        tmp_path, '[learner]\ncheckpoint_dir = "/a"\n[scheduler]\ncheckpoint_dir = "/b"\n'
    )
    with pytest.raises(
        ConfigError,
        match=r"learner\.checkpoint_dir must equal "
        r"scheduler\.checkpoint_dir",
    ):
        load_config(SchedulerConfig, other)


# --- experiment.tasks: several tasks in one run (issue 30) -----------------------------------


def test_one_task_by_default_and_a_table_of_several(tmp_path):
    assert load_config(DemoConfig, None, env={}).experiment.task_weights() == {"matmul": 1.0}
    single = load_config(DemoConfig, write(tmp_path, '[experiment]\ntask = "gemv"\n'), env={})
    assert single.experiment.task_weights() == {"gemv": 1.0}
    path = write(tmp_path, "[experiment.tasks]\nmatmul = 2\ngemv = 1\nstencil = 0.5\n")
    several = load_config(DemoConfig, path, env={})
    assert several.experiment.task_weights() == {"matmul": 2.0, "gemv": 1.0, "stencil": 0.5}
    # task inside tasks is consistent; the environment can name the table as JSON too
    path = write(tmp_path, '[experiment]\ntask = "gemv"\n[experiment.tasks]\ngemv = 1\nspmv = 3\n')
    assert load_config(DemoConfig, path, env={}).experiment.task_weights() == {
        "gemv": 1.0,
        "spmv": 3.0,
    }
    env = {"HPCRL__EXPERIMENT__TASKS": '{"spmv": 1, "matmul": 1}'}
    assert set(load_config(DemoConfig, None, env=env).experiment.task_weights()) == {
        "spmv",
        "matmul",
    }


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        ("[experiment.tasks]\nmatmul = 0\n", "weight of 'matmul' must be > 0"),
        ("[experiment.tasks]\nmatmul = -1\ngemv = 1\n", "weight of 'matmul' must be > 0"),
        ("[experiment.tasks]\nmatmul = inf\n", "must be > 0 and finite"),
        ("[experiment.tasks]\nmatmul = nan\n", "must be > 0 and finite"),
        ('[experiment.tasks]\n"" = 1\n', "may not be empty"),
        ('[experiment.tasks]\nmatmul = "heavy"\n', "experiment.tasks.matmul"),
        (
            '[experiment]\ntask = "gemv"\n[experiment.tasks]\nmatmul = 1\nstencil = 1\n',
            "task = 'gemv' is not in tasks (matmul, stencil)",
        ),
    ],
)
def test_a_bad_tasks_table_is_refused_clearly(tmp_path, toml, expected):
    with pytest.raises(ConfigError) as info:
        load_config(DemoConfig, write(tmp_path, toml), env={})
    assert expected in str(info.value)
