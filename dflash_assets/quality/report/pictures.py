"""What the two pictures (histogram.py, planner_plot.py) share: an Agg figure with fixed margins and PNG bytes that
depend only on what is drawn. matplotlib's object API, not pyplot (no global backend, no figure registry, safe in a
long-running Dagster process); fixed margins, not `tight_layout`, which lays out every text once more (a third of
the CPU), wide enough for y tick labels of up to six digits.
"""

import io

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

MARGINS = {"left": 0.11, "right": 0.98, "bottom": 0.13, "top": 0.92}


def new_figure(width: float, height: float) -> Figure:
    """A figure of `width` x `height` inches at 100 dpi on an Agg canvas, with the pictures' margins."""
    fig = Figure(figsize=(width, height), dpi=100)  # (its `subplotpars` are reset to the rc defaults when it starts)
    fig.subplots_adjust(**MARGINS)
    FigureCanvasAgg(fig)
    return fig


def png(fig: Figure, description: str | None = None) -> bytes:
    """The PNG bytes of `fig`; `description` goes into its Description text (what it shows, for a reader)."""
    buf = io.BytesIO()
    metadata = {"Software": None} | ({"Description": description} if description else {})
    fig.savefig(buf, format="png", metadata=metadata)  # no version stamp: the same picture, the same bytes
    return buf.getvalue()
