"""README.md stays true: it names every config key and every metric the code defines."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _reference():
    spec = importlib.util.spec_from_file_location("reference", ROOT / "deploy" / "reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_names_every_setting_and_metric():
    reference = _reference()
    readme = (ROOT / "README.md").read_text()
    keys = [key for section, model in reference.config_sections().items()
            for key, _default, _meaning in reference.setting_rows(section, model)]
    metrics = [row[0] for rows in reference.metric_rows().values() for row in rows]
    assert len(keys) > 50 and len(metrics) > 30  # the reference itself found them
    missing_keys = [key for key in keys if f"`{key}`" not in readme]
    missing_metrics = [name for name in metrics if f"`{name}`" not in readme]
    assert not missing_keys, f"README.md lacks settings: {missing_keys}"
    assert not missing_metrics, f"README.md lacks metrics: {missing_metrics}"


def test_readme_starts_with_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    first = readme.index("```bash")
    block = readme[first: readme.index("```", first + 7)]
    assert "make demo" in block and "make test" in block
