"""``eval/plot.png``: each episode's best reward and length, successes marked, the success rate with its interval."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_summary(summary: dict[str, Any], path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    eps = summary["per_episode"]
    idx = [e["episode"] for e in eps]
    colors = ["tab:green" if e["success"] else ("tab:gray" if e["error"] else "tab:red") for e in eps]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.bar(idx, [e["max_reward"] for e in eps], color=colors)
    ax1.set_xlabel("episode")
    ax1.set_ylabel("max reward")
    lo, hi = summary["success_ci95"]
    ax1.set_title(f"{summary['policy']} on {summary['env']}: success {summary['success_rate']:.2f} "
                  f"[{lo:.2f}, {hi:.2f}] (n={summary['episodes']})", fontsize=9)
    ax1.set_ylim(0, 1.05)
    ax2.bar(idx, [e["length"] for e in eps], color=colors)
    ax2.set_xlabel("episode")
    ax2.set_ylabel("steps")
    ax2.set_title("episode length (green: success, red: failure, gray: error)", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
