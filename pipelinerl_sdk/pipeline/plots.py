"""PNG plots of a run: reward over time, lag histogram, pause per update."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def write_plots(rows: Sequence[dict[str, Any]], out: Path, *, title: str) -> list[Path]:
    """Write ``reward.png``, ``lag.png`` and ``pause.png`` into ``out``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    t = [r["time_s"] for r in rows]

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(t, [r["reward"] for r in rows], alpha=0.4, label="batch mean")
    ax.plot(t, [r["reward_moving"] for r in rows], label="moving mean")
    ax.set(xlabel="seconds", ylabel="reward", title=f"reward: {title}", ylim=(-0.02, 1.02))
    ax.legend(loc="lower right")
    paths.append(_save(fig, out / "reward.png"))

    fig, ax = plt.subplots(figsize=(6, 3.5))
    lags = [lag for r in rows for lag in r["lags"]]
    bins = range(0, max(lags, default=0) + 2)
    ax.hist(lags, bins=list(bins), align="left", rwidth=0.8)
    ax.set(
        xlabel="lag (optimizer steps between the weights that generated a group and its training)",
        ylabel="groups",
        title="lag",
    )
    paths.append(_save(fig, out / "lag.png"))

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in rows], [1e3 * r["pause_s"] for r in rows], marker=".", linestyle="")
    ax.set(xlabel="update (optimizer step)", ylabel="generation pause (ms)", title="pause per weight update")
    paths.append(_save(fig, out / "pause.png"))
    return paths


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
