"""What `dflash probe` prints when the probe is done: its rows, the share still cut at candidate caps, measured,
how precisely, and the command to run next."""

from __future__ import annotations

from pathlib import Path

from dflash_assets.generation.probe import ProbeRun, probe_root
from dflash_assets.quality.outcome import Thresholds, num, pct
from dflash_assets.quality.planner import DEFAULT_CANDIDATES, CapPlan, PlanError, plan_caps
from dflash_assets.quality.probe_estimates import precision_text


def next_cap(plan: CapPlan, limit: float = Thresholds().truncation_rate_max) -> int | None:
    """The smallest measured cap above the current one at which no more than `limit` (the truncation check's
    threshold) of the rows are still cut; None when no measured cap gets there."""
    return next((e.cap for e in plan.estimates if e.basis != "model" and e.cap > plan.cap
                 and e.truncation_rate.value <= limit), None)


def probe_summary(result: ProbeRun, data_dir: str | Path, urls: list[str], shards: list[str],
                  limit: float = Thresholds().truncation_rate_max) -> str:
    run = result.run
    lines = [f"length probe: {num(result.sampled)} of {num(result.prompts_total)} prompts at cap {num(result.cap)}, "
             f"config {run.config_hash}: {num(run.completed)} completed + {num(run.rejected)} rejected + "
             f"{num(run.failed)} failed; {num(run.output_tokens)} output tokens this run "
             f"({run.elapsed_s:.1f} s), rows in {probe_root(data_dir)}"]
    try:  # the default candidates and the probe's own cap: what it measured at its largest
        plan = plan_caps(data_dir, candidates=sorted({*DEFAULT_CANDIDATES, result.cap}))
    except PlanError as e:
        return "\n".join(lines + [f"no cap plan: {e}"])
    alone = plan.probe is None and plan.config_hash == run.config_hash  # no run rows yet: the probe's rows only
    source = "the probe's rows alone" if alone else \
        f"{num(plan.rows)} rows at cap {num(plan.cap)}" + (" and the probe" if plan.probe else "")
    lines += ["", f"share still cut, from {source} (95% intervals):",
              f"{'cap':>8}  {'cut':<24} {'runaways':>9}  from"]
    label = {"rows": "measured (the rows)", "probe": "measured (probe)", "model": "model (lognormal tail)"}
    for e in plan.estimates:
        r = e.truncation_rate
        lines.append(f"{num(e.cap):>8}  {f'{pct(r.value)} ({pct(r.low)}–{pct(r.high)})':<24} "
                     f"{pct(e.runaway_rate.value):>9}  {label[e.basis]}")
    if plan.probe_precision:
        lines += ["", f"precision: {precision_text(plan.probe_precision, plan.cap)}"]
    lines += [f"- {note}" for note in plan.notes]
    cap = next_cap(plan, limit)
    if cap is None:
        lines += ["", f"next: no measured cap cuts {pct(limit)} or fewer of the rows (runaways alone: "
                      f"{pct(plan.runaways / plan.rows)}); look at the runaways and the sampling settings before "
                      f"raising the cap: dflash report --data-dir {data_dir}"]
    elif alone:
        lines += ["", f"next: generate the run at cap {num(cap)}, the smallest measured cap that cuts {pct(limit)} or "
                      f"fewer: " + " ; ".join(f"dflash generate --shard {s} --urls {','.join(urls)} --data-dir "
                                              f"{data_dir} --max-output-tokens {cap}" for s in shards)]
    else:
        lines += ["", f"next: dflash report --data-dir {data_dir} (the whole cap plan); to raise the cap to "
                      f"{num(cap)}, the smallest measured cap that cuts {pct(limit)} or fewer: DFLASH_DATA_DIR="
                      f"{data_dir} dflash continue --to {cap}"]
    return "\n".join(lines)
