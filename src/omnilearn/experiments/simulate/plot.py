"""``omnilearn simulate --plot OUT.png``: step time against the ideal per controller, and a few workers' batches.

matplotlib comes with the ``[experiments]`` extra and is imported only here, only when a plot is asked for.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from omnilearn.config import ConfigError


def plot(path: str, traces: list, ideal_s: np.ndarray, watched: np.ndarray, change_steps: tuple[int, ...]) -> None:
    """Top: each controller's step ms and the ideal; bottom: the watched workers' batches per adaptive controller."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'omnilearn-hetero[experiments]'") from None
    adaptive = [t for t in traces if t.changes or t.name not in ("uniform", "static")]
    fig, axes = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    steps = np.arange(ideal_s.size)
    for t in traces:
        axes[0].plot(steps, 1e3 * t.step_s, lw=0.8, label=t.name)
    axes[0].plot(steps, 1e3 * ideal_s, "k--", lw=0.8, label="ideal")
    axes[0].set_ylabel("step ms (in-step)")
    axes[0].legend(fontsize=8)
    styles = ["-", "--", ":", "-."]
    for j, t in enumerate(adaptive):
        for k, worker in enumerate(watched):
            axes[1].plot(steps, t.batches[:, k], styles[j % len(styles)], lw=0.9, color=f"C{k}",
                         label=f"{t.name} w{worker}")
    axes[1].set_ylabel("batch")
    axes[1].set_xlabel("step")
    if adaptive:
        axes[1].legend(fontsize=7, ncol=2)
    for ax in axes:
        for s in change_steps:
            ax.axvline(s, color="grey", lw=0.5)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
