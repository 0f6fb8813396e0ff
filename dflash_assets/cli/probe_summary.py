"""What `dflash probe` prints when the probe is done: its rows, the share still cut at candidate caps, measured,
how precisely, and the command to run next."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from dflash_assets.generation.probe import ProbeResult, probe_root
from dflash_assets.quality.outcome import num, pct
from dflash_assets.quality.planning.estimate import DEFAULT_CANDIDATES, CapPlan
from dflash_assets.quality.planning.fit import PlanError
from dflash_assets.quality.planning.planner import plan_caps
from dflash_assets.quality.planning.probe_estimates import precision_text, probe_label
from dflash_assets.quality.report.answer import recommended_cap
from dflash_assets.settings import QualitySettings


class NextCommands(Protocol):
    """The commands the summary names next, as the terminal prints them (cli/generate.py)."""

    def report(self) -> str: ...

    def continue_to(self, cap: int) -> str: ...

    def generate(self, shard: str, cap: int) -> str: ...


def probe_summary(
    result: ProbeResult,
    data_dir: str | Path,
    shards: list[str],
    commands: NextCommands,
    limit: float = QualitySettings().truncation_rate_max,
) -> str:
    run = result.run
    what = "of the run's honest cut rows, continued to" if result.mode == "cut_rows" else "prompts at"
    lines = [
        f"length probe: {num(result.sampled)} of {num(result.prompts_total)} {what} cap {num(result.cap)}, "
        f"config {run.config_hash}: {num(run.completed)} completed + {num(run.rejected)} rejected + "
        f"{num(run.failed)} failed; {num(run.output_tokens)} output tokens this run "
        f"({run.elapsed_s:.1f} s), rows in {probe_root(data_dir)}"
    ]
    try:  # the default candidates and the probe's own cap: what it measured at its largest
        plan = plan_caps(data_dir, candidates=sorted({*DEFAULT_CANDIDATES, result.cap}))
    except PlanError as e:
        return "\n".join(lines + [f"no cap plan: {e}"])
    alone = plan.probe is None and plan.config_hash == run.config_hash  # no run rows yet: the probe's rows only
    source = (
        "the probe's rows alone"
        if alone
        else f"{num(plan.rows)} rows at cap {num(plan.cap)}" + (" and the probe" if plan.probe else "")
    )
    lines += ["", f"share still cut, from {source} (95% intervals):", f"{'cap':>8}  {'cut':<24} {'runaways':>9}  from"]
    continued = plan.probe is not None and plan.probe.continued_from is not None
    label = {
        "rows": "measured (the rows)",
        "probe": f"measured ({probe_label(plan.probe)})" if continued else "measured (probe)",
        "model": "model (lognormal tail)",
    }
    for estimate in plan.estimates:
        r = estimate.truncation_rate
        lines.append(
            f"{num(estimate.cap):>8}  {f'{pct(r.value)} ({pct(r.low)}–{pct(r.high)})':<24} "
            f"{pct(estimate.runaway_rate.value):>9}  {label[estimate.basis]}"
        )
    if plan.probe_precision:
        lines += ["", f"precision: {precision_text(plan.probe_precision, plan.cap)}"]
    lines += [f"- {note}" for note in plan.notes]
    return "\n".join(
        [
            *lines,
            "",
            _next(plan, limit, commands, shards, label) if alone else _next_raise(plan, limit, commands, label),
        ]
    )


def _next(plan: CapPlan, limit: float, commands: NextCommands, shards, label: dict) -> str:
    """A probe alone: the run to generate at the smallest measured cap that cuts no more than `limit`."""
    first = next((e for e in plan.estimates if e.basis != "model" and e.truncation_rate.value <= limit), None)
    if first is None:
        return _no_cap(plan, limit, commands)
    generate = " ; ".join(commands.generate(s, first.cap) for s in shards)
    smallest = f"the smallest measured cap that cuts {pct(limit)} or fewer"
    return f"next: generate the run at cap {num(first.cap)}, {smallest}: {generate}"


def _next_raise(plan: CapPlan, limit: float, commands: NextCommands, label: dict) -> str:
    """A probe of a data dir's rows: nothing to raise, or the cap to continue the cut rows to."""
    if plan.truncated / plan.rows <= limit:
        return (
            f"next: nothing to raise: the cap {num(plan.cap)} cuts {pct(limit)} or fewer already; {commands.report()}"
        )
    rec = recommended_cap(plan, limit)
    if rec is None or rec.truncation_rate.value > limit:
        return _no_cap(plan, limit, commands)
    return (
        f"next: {commands.report()} (the whole cap plan); to raise the cap to {num(rec.cap)}, the smallest that cuts "
        f"{pct(limit)} or fewer ({pct(rec.truncation_rate.value)}, {label[rec.basis]}): {commands.continue_to(rec.cap)}"
    )


def _no_cap(plan: CapPlan, limit: float, commands: NextCommands) -> str:
    return (
        f"next: no candidate cap cuts {pct(limit)} or fewer of the rows (runaways alone: "
        f"{pct(plan.runaways / plan.rows)}); look at the runaways and the sampling settings before raising the "
        f"cap: {commands.report()}"
    )
