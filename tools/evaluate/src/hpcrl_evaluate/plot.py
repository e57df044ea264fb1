"""The evaluation as one figure: version 0 against the final version, with the gain's CI."""

from __future__ import annotations

from pathlib import Path
from typing import Any

PLOTTED = ("share_correct", "mean_reward", "mean_gflops")


def plot(report: dict[str, Any], out: Path) -> None:
    """Bars of the first and last version for each plotted metric. The last bar's whisker is
    the first version's value plus the 95 % interval of the gain: where the final version
    could be, given what the paired samples say about the difference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    versions = report["versions"]
    first, last = versions[0], versions[-1]
    comparison = report.get("comparison")
    labels = report.get("metric_labels", {})
    figure, axes = plt.subplots(1, len(PLOTTED), figsize=(4 * len(PLOTTED), 4))
    for axis, name in zip(axes, PLOTTED, strict=True):
        values = [first["metrics"][name], last["metrics"][name]]
        names = [f"v{first['version']}", f"v{last['version']}"]
        axis.bar(names, values, color=["#9aa5b1", "#2f7ed8"])
        title = labels.get(name, name)
        if comparison is not None:
            gain = comparison["metrics"][name]
            # The bar's top is first + gain; a percentile interval need not straddle it.
            whisker = [
                [max(0.0, gain["gain"] - gain["low"])],
                [max(0.0, gain["high"] - gain["gain"])],
            ]
            axis.errorbar([1], [values[1]], yerr=whisker, fmt="none", ecolor="black", capsize=6)
            title += f"\ngain {gain['gain']:+.3g} [{gain['low']:+.3g}, {gain['high']:+.3g}]"
        axis.axhline(0.0, color="black", linewidth=0.5)
        axis.set_title(title, fontsize=10)
    samples = report["sampling"]["samples"]
    figure.suptitle(
        f"Fixed evaluation set: {len(report['prompts'])} prompts x {samples} "
        "samples, same seeds (whiskers: 95 % CI of the gain)",
        fontsize=10,
    )
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=120)
    plt.close(figure)
