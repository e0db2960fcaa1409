"""The demos' figures: one way to open and to save them (matplotlib's Agg backend; no figure without matplotlib)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def new_axes() -> tuple[Any, Any] | None:
    """A 7 x 4 inch figure and its axes, or None where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt.subplots(figsize=(7, 4))


def save(fig: Any, ax: Any, path: Path) -> Path:
    """Grid and legend on ``ax``, ``fig`` written to ``path`` (120 dpi) and closed; returns ``path``."""
    import matplotlib.pyplot as plt

    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
