"""The cap plan as a picture: P(length > x) on log axes: observed below the cap, the probe's, the fitted tail with its
95% band, the runaways' floor, and what each candidate cap would still cut (the figure and its PNG: pictures.py).
"""

import numpy as np

from dflash_assets.quality.outcome import pct
from dflash_assets.quality.planning.estimate import CapPlan
from dflash_assets.quality.report.pictures import new_figure, png


def cap_plan_png(plan: CapPlan, window: tuple[int, int] | None = None, description: str = "") -> bytes:
    """`window`: (max_length, where it ends in completion tokens for the median prompt), marked on the picture;
    `description`: the PNG's Description (CapAnswer.description)."""
    fig = new_figure(8, 6.2)
    fig.subplots_adjust(bottom=0.34)  # the legend goes below the axes, clear of the caps' labels
    ax = fig.add_subplot()
    floor = 0.5 / plan.rows  # below one row in the sample a probability is invisible, not zero
    _observed(ax, plan, floor)
    _fitted(ax, plan, floor)
    ax.axvline(plan.cap, color="black", linestyle="--", linewidth=1)
    if window:
        max_length, at = window
        ax.axvspan(at, max(at, *(e.cap for e in plan.estimates)) * 1.3, color="tab:orange", alpha=0.08, linewidth=0)
        ax.axvline(
            at,
            color="tab:orange",
            linestyle="-",
            linewidth=2,
            label=f"trainer's window max_length {max_length:,} (median prompt): past it nothing is trained",
        )
    _candidates(ax, plan)
    ax.set_xscale("log")
    ax.set_yscale("log")
    lowest = min(
        [t[2] for t in plan.tail]
        + [e.truncation_rate.value or 1.0 for e in plan.estimates]
        + [floor]
        + [s for _, s in plan.probe_survival if s > 0]
    )
    ax.set_ylim(max(lowest / 2, floor / 10), 1.05)
    ax.set_xlabel("completion tokens x (the cap, dashed; candidate caps, dotted, with the context each needs)")
    ax.set_ylabel("P(length > x) = share cut at cap x")
    ax.set_title(f"Cap plan{', config ' + plan.config_hash if plan.config_hash else ''}: current cap {plan.cap:,}")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=1, fontsize="small", frameon=False)
    return png(fig, description or None)


def _observed(ax, plan: CapPlan, floor: float) -> None:
    """What was measured: the rows below the cap, the probe's rows beyond it, the runaways' floor."""
    if plan.empirical:
        x, s = np.array(plan.empirical, dtype=float).T
        x, s = x[x >= 1], s[x >= 1]  # a log axis has no 0-token rows
        # start the steps at the smallest length, and end them at the cap with the share that was cut there
        x, s = np.r_[x[0], x, plan.cap], np.r_[1.0, s, plan.truncated / plan.rows]
        ax.step(
            x, np.maximum(s, floor), where="post", color="black", linewidth=1.5, label=f"observed ({plan.rows:,} rows)"
        )
    if plan.probe_survival:
        x, s = np.array(plan.probe_survival, dtype=float).T
        x, s = x[x >= 1], s[x >= 1]
        n = len(plan.probe.completion_tokens) if plan.probe else None
        ax.step(
            np.r_[x[0], x],
            np.maximum(np.r_[1.0, s], floor),
            where="post",
            color="tab:green",
            linewidth=1.5,
            label=f"length probe{f' ({n:,} rows)' if n else ''}: measured",
        )
    loops = plan.runaways / plan.rows
    if loops:
        ax.axhline(
            loops, color="tab:purple", linestyle="-.", linewidth=1, label=f"runaways: {pct(loops)}, cut at any cap"
        )


def _fitted(ax, plan: CapPlan, floor: float) -> None:
    """The lognormal fit below the cap (where it can be checked) and the model beyond it, with its band."""
    if not plan.fit:
        return
    loops = plan.runaways / plan.rows
    start = max(plan.fit.fit_from_tokens, plan.empirical[0][0] if plan.empirical else 1, 1)
    below = np.geomspace(start, plan.cap, 64)
    # the fit is of the honest rows; the runaways sit above every x below the cap as well
    ax.plot(
        below,
        (1 - loops) * plan.fit.survival(below) + loops,
        color="tab:blue",
        linestyle=":",
        linewidth=1,
        label=f"lognormal fit (median {np.exp(plan.fit.mu):,.0f}, sigma {plan.fit.sigma:.2f})",
    )
    tx, ts, lo, hi = np.array(plan.tail).T
    ax.plot(tx, ts, color="tab:blue", linewidth=1.8, label="model beyond the cap")
    ax.fill_between(
        tx,
        np.maximum(lo, floor / 10),
        np.maximum(hi, floor / 10),
        color="tab:blue",
        alpha=0.2,
        linewidth=0,
        label=f"95% band ({plan.bootstrap} bootstrap resamples)",
    )


def _candidates(ax, plan: CapPlan) -> None:
    """Each candidate cap, dotted, with what it would still cut and the context it needs."""
    for e in plan.estimates:
        color = "black" if e.cap == plan.cap else "tab:red"
        if e.cap != plan.cap:
            ax.axvline(e.cap, color=color, linestyle=":", linewidth=1)
        context = f", context {e.context_needed_max:,}" if e.context_needed_max is not None else ""
        basis = {"rows": "", "probe": " (probe)", "model": " (model)"}[e.basis]
        ax.text(
            e.cap,
            0.02,
            f" {e.cap:,}: {pct(e.truncation_rate.value)} cut{basis}{context}",
            transform=ax.get_xaxis_transform(),
            rotation=90,
            ha="right",
            va="bottom",
            fontsize="x-small",
            color=color,
        )
