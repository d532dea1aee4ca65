"""``loongforge plot RUN``: a PNG of the loss and throughput curves of a run directory."""

from __future__ import annotations

from pathlib import Path

from loongforge.metrics import read_metrics


def plot_run(run_dir: str | Path, output: str | Path | None = None) -> Path:
    """Write ``RUN/plot.png`` (or ``output``) with loss and throughput against the step; return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    steps = [r["step"] for r in records]
    # NOTE: the model's own unit (images, samples) when it reports one, else tokens
    keys = sorted({k for r in records for k in r if k.endswith("_per_s")}, key=lambda k: (k == "tokens_per_s", k))
    rate_key = keys[0] if keys else None
    fig, axes = plt.subplots(1, 2 if rate_key else 1, figsize=(11 if rate_key else 6, 4), squeeze=False)
    ax = axes[0][0]
    ax.plot(steps, [r.get("loss", float("nan")) for r in records], color="tab:blue")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("training loss")
    ax.grid(alpha=0.3)
    if rate_key:
        ax2 = axes[0][1]
        ax2.plot(steps, [r.get(rate_key, float("nan")) for r in records], color="tab:green")
        ax2.set_xlabel("step")
        ax2.set_ylabel(rate_key.replace("_per_s", "/s"))
        ax2.set_title("throughput")
        ax2.grid(alpha=0.3)
    fig.suptitle(Path(run_dir).name)
    fig.tight_layout()
    out = Path(output) if output else Path(run_dir) / "plot.png"
    try:
        fig.savefig(out, dpi=100)
    except OSError as exc:
        from loongforge.errors import LoongForgeError

        raise LoongForgeError(f"--output '{out}': cannot write the plot ({exc.strerror or exc})") from None
    finally:
        plt.close(fig)
    return out
