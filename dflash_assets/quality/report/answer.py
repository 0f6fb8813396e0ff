"""A run's question answered for people, once per config (`cap_answers`): what was cut (by rules.FIGURES), the
length percentiles, what the export holds (its manifest), the tokens decoded and trained, the recommendation and the
next command; rendered by every view.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dflash_assets.quality.outcome import num, pct
from dflash_assets.quality.planning.estimate import CapEstimate, CapPlan
from dflash_assets.quality.planning.fit import PlanError
from dflash_assets.quality.planning.planner import plan_caps
from dflash_assets.quality.planning.window_plan import WindowPlan, window_plan
from dflash_assets.quality.report.lengths import ConfigStats, length_quality
from dflash_assets.quality.training.export import trained_words
from dflash_assets.settings import Deployment, QualitySettings, TrainerSettings
from dflash_assets.store.configs import latest_order
from dflash_assets.store.storage import is_uri


@dataclass(frozen=True)
class Exported:
    """What the export of a config holds, read from its own manifest (quality/training/export.py): never claimed, counted."""

    manifest: Path
    samples: int  # the manifest's `rows`: JSONL lines written, train and held out (a conversation each in text forms)
    form: str
    window_complete_kept: int
    no_trainable_tokens: int
    conversations_not_whole: int
    trained: str = ""  # what the trainer will train of it (export.trained_words)

    @classmethod
    def read(cls, manifest: Path) -> Exported | None:
        try:
            m = json.loads(manifest.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return cls(
            manifest=manifest,
            samples=int(m.get("rows") or 0),
            form=str(m.get("form") or "-"),
            window_complete_kept=int(m.get("window_complete_kept") or 0),
            no_trainable_tokens=int((m.get("excluded") or {}).get("no_trainable_tokens") or 0),
            conversations_not_whole=int(m.get("conversations_not_whole") or 0),
            trained=trained_words(m, short=True),
        )


@dataclass(frozen=True)
class CapAnswer:
    """One config's answer: what was cut and what the trainer gets, each figure by its rules.FIGURES definition and
    unit, computed once (cap_answers) and rendered by every view (lines, markdown, description)."""

    stats: ConfigStats  # the config's figures (length_quality's by_config)
    plan: CapPlan | None
    plan_error: str | None
    recommended: CapEstimate | None  # the smallest candidate cap whose predicted share cut is within the limit
    max_length: int = TrainerSettings().max_length  # the trainer's window the rows are judged against
    window_plan: WindowPlan | None = None  # decoded and trained tokens per candidate cap and the window policy
    exported: Exported | None = None  # None: no export of this config yet
    scope: str = ""  # "": every shard of the config; else the shard(s) counted ("shard 00000")
    limit: float = QualitySettings().truncation_rate_max  # the blocking share cut inside the window

    @property
    def config_hash(self) -> str:
        return self.stats.config_hash

    @property
    def cap(self) -> int:
        return self.stats.config_cap

    @property
    def rows(self) -> int:
        """Turn rows: one per generated turn (one per prompt under last_turn)."""
        return self.stats.rows

    @property
    def truncated(self) -> int:
        """Cut at the cap or stopped as runaways: the rows `dflash continue` takes up."""
        return self.stats.truncated_rows

    @property
    def _percentiles(self) -> tuple[int | None, ...]:
        return self.stats.p50, self.stats.p90, self.stats.p99, self.stats.max

    @property
    def cuts_matter(self) -> bool:
        """Whether any cut row lies inside the window: only those change what the trainer reads."""
        return self.stats.cut_inside_window_rows > 0

    @property
    def at_cap(self) -> list[str]:
        """Which of P90 and P99 equal the cap: the tell-tale that the cap, not the prompts, set the lengths."""
        return [name for name, v in zip(("P90", "P99"), self._percentiles[1:3]) if v is not None and v >= self.cap]

    def share(self, count: int) -> str:
        return pct(count / self.rows) if self.rows else "-"

    @property
    def blocked(self) -> bool:
        """Whether the share cut inside the window is over the limit: the blocking check stops its export."""
        return bool(self.rows) and self.stats.cut_inside_window_rows / self.rows > self.limit

    @property
    def next_cap(self) -> int | None:
        """The cap to continue the cut rows to: the recommended one, else, when the cuts inside the window block and
        the plan offers none, the trainer's window; None when nothing is to do."""
        if self.recommended is not None:
            return self.recommended.cap
        return self.max_length if self.blocked and self.cap < self.max_length else None

    @property
    def next_settings(self) -> dict[str, str | int]:
        """The settings of the next command (flag: value): the window policy when every cut lies past the window, a
        larger cap when the cuts inside it are over the limit and a candidate gets there; {} when nothing is to do."""
        if self.stats.cut_at_cap_rows and not self.cuts_matter:
            return {} if self.stats.window_policy else {"--cap-policy": "window", "--max-output-tokens": self.cap}
        return {"--max-output-tokens": self.next_cap} if self.next_cap else {}

    @property
    def recommendation(self) -> str:
        inside = self.share(self.stats.cut_inside_window_rows)
        if not self.stats.cut_at_cap_rows:
            return "nothing was cut at the cap: it is large enough for these prompts"
        if not self.cuts_matter:
            return (
                f"every cut row lies at or past the trainer's window max_length {num(self.max_length)}: the trainer "
                f"reads each as the complete answer, so a larger cap buys no trained token; "
                + (
                    "the window policy already decodes only what it reads"
                    if self.stats.window_policy
                    else "decode only what it reads"
                )
            )
        if self.recommended is not None:
            e = self.recommended
            return (
                f"recommended cap: {num(e.cap)} (predicted {pct(e.truncation_rate.value)} cut; above "
                f"{num(self.cap)} the tail is a model)"
            )
        if self.next_cap is not None:
            why = self.plan_error.rstrip(".") if self.plan is None and self.plan_error else "no candidate gets there"
            return (
                f"{inside} cut inside the window, over the limit {pct(self.limit)}, and "
                f"the cap plan has no cap for it ({why}): at cap {num(self.next_cap)}, the trainer's window, no row "
                f"is cut inside it"
            )
        if self.blocked:
            return f"{inside} cut inside the window, over the limit {pct(self.limit)}"
        return "the cuts inside the window are within the limit"

    def next_command(self, command: str) -> str | None:
        """`command` (say "dflash demo", as printed) with the next settings in place of its own (a flag is given once),
        or None when there is nothing to change: never the config just run."""
        words = command.split(" ")
        for flag, value in self.next_settings.items():
            if flag in words[:-1]:
                words[words.index(flag) + 1] = str(value)
            else:
                words += [flag, str(value)]
        return None if words == command.split(" ") else " ".join(words)

    def headline(self, export_command: str | None = None) -> list[str]:
        """The answer in a few lines, each figure with its unit (the definitions: rules.FIGURES)."""
        stats = self.stats
        cut, inside, complete = stats.cut_at_cap_rows, stats.cut_inside_window_rows, stats.window_complete_rows
        figures = "  ".join(f"{k} {_n(v)}" for k, v in zip(("P50", "P90", "P99", "max"), self._percentiles))
        at_cap = (
            f": {' and '.join(self.at_cap)} {'equal' if len(self.at_cap) > 1 else 'equals'} the cap"
            if self.at_cap
            else ""
        )
        ratio = f"{stats.decoded_tokens / stats.trained_tokens:.2f}" if stats.trained_tokens else "-"
        return [
            f"config {self.config_hash}{f' ({self.scope})' if self.scope else ''}: cap {num(self.cap)}, window "
            f"{num(self.max_length)}, {num(self.rows)} turn rows of {num(stats.conversations)} conversations"
            + (f" ({num(stats.shortened_conversations)} shortened)" if stats.shortened_conversations else ""),
            f"  cut at the cap {self.share(cut)} ({num(cut)} turn rows); cut inside the window {self.share(inside)} "
            f"({num(inside)}, the blocking share); window-complete {self.share(complete)} ({num(complete)}); runaways "
            f"{num(stats.runaway_rows)}; filling the window {num(stats.fills_window_rows)}",
            f"  completion tokens {figures}{at_cap}",
            f"  decoded {num(stats.decoded_tokens)} tokens, trained {num(stats.trained_tokens)} ({ratio} decoded per "
            f"trained token)",
            f"  {self.export_line(export_command)}",
        ]

    def one_line(self) -> str:
        """The answer of a config listed beside the latest one."""
        return (
            f"config {self.config_hash}: cap {num(self.cap)}, {num(self.rows)} turn rows; cut at the cap "
            f"{self.share(self.stats.cut_at_cap_rows)}, inside the window "
            f"{self.share(self.stats.cut_inside_window_rows)}"
        )

    def export_line(self, export_command: str | None = None) -> str:
        """What the export holds, as its manifest counts it (else the command that writes it)."""
        e = self.exported
        if e is None and self.blocked:
            return "export: none (the blocking check truncation_rate stops it)"
        if e is None:
            return f"export: none yet: {export_command or 'dflash export --config ' + self.config_hash}"
        return (
            f"export: {num(e.samples)} samples ({e.form}), {num(e.window_complete_kept)} window-complete turn rows "
            f"kept; left out: {num(e.no_trainable_tokens)} turn rows with no trainable token, "
            f"{num(e.conversations_not_whole)} conversations not whole"
            + (f"; {e.trained}" if e.trained else "")
            + f" ({e.manifest})"
        )

    def lines(self, command: str = "dflash demo", export_command: str | None = None) -> list[str]:
        """The answer, the recommendation and the next command: the closing lines of a run, the report's head."""
        nxt = self.next_command(command)
        return [*self.headline(export_command), f"  {self.recommendation}", *([f"next: {nxt}"] if nxt else [])]

    def markdown(self) -> str:
        """The answer for the UI's metadata (Markdown), the definitions one link away."""
        return "\n".join(f"- {line.strip()}" for line in self.lines("dflash backfill")) + (
            "\n\nDefinitions and units: docs/quality-gate.md (The figures)."
        )

    def description(self) -> str:
        """The answer in one paragraph, for a PNG's Description."""
        return " ".join(line.strip() for line in self.headline()[:3])


def _n(v: int | None) -> str:
    return "-" if v is None else num(v)


def recommended_cap(
    plan: CapPlan, limit: float, cut_inside_window: int | None = None, ceiling: int | None = None
) -> CapEstimate | None:
    """The smallest candidate cap at or above the current one whose predicted share cut is within `limit`.

    None when no row was cut inside the trainer's window (a larger cap buys no trained token) or no candidate gets
    there. `ceiling`: the cap that lets every prompt reach the window; none larger is recommended.
    """
    cut = plan.truncated if cut_inside_window is None else cut_inside_window
    if not cut or cut / plan.rows <= limit:
        return None
    larger = [e for e in plan.estimates if e.cap > plan.cap and (ceiling is None or e.cap <= ceiling)]
    within = [e for e in larger if e.truncation_rate.value <= limit]
    return within[0] if within else (larger[-1] if larger else None)


def answer_of(
    stats: ConfigStats,
    quality: QualitySettings,
    exports: Path,
    plan: CapPlan | None = None,
    plan_error: str | None = "not planned here: length_quality_summary plans each config over all its shards",
    wp: WindowPlan | None = None,
    scope: str = "",
) -> CapAnswer:
    """The answer of one config from its stats (length_quality's `by_config`), its export's manifest under `exports`
    and its cap plan; `scope`: "" for every shard, else the shard(s) the stats count."""
    ceiling = wp.recommended.cap if wp is not None and wp.cut_inside_window else None
    limit = quality.truncation_rate_max
    return CapAnswer(
        stats,
        plan,
        plan_error if plan is None else None,
        recommended_cap(plan, limit, stats.cut_inside_window_rows, ceiling) if plan else None,
        quality.trainer.max_length,
        wp,
        Exported.read(exports / stats.config_hash / "manifest.json"),
        scope,
        limit,
    )


def training_dir(data_dir: str | Path) -> Path:
    """Where the exports of a data dir are (a folder per config): beside its rows, or under DFLASH_LOCAL_DIR when
    the data dir is an object store (defs/resources.py DataDirResource.local_dir)."""
    return Path(Deployment.LOCAL_DIR.value() if is_uri(str(data_dir)) else data_dir) / "training"


def cap_answers(
    data_dir: str | Path,
    quality: QualitySettings = QualitySettings(),
    config_hash: str | None = None,
    exports: Path | None = None,
) -> list[CapAnswer]:
    """One answer per config of the data dir (or the one asked for), the latest first; what it says of an export is
    read from `exports` (default: training_dir) / <config> / manifest.json."""
    exports = training_dir(data_dir) if exports is None else exports
    report = length_quality(data_dir, max_length=quality.trainer.max_length, runaway=quality.runaway)
    by_hash = {s.config_hash: s for s in map(ConfigStats.of, report["by_config"])}
    answers = []
    for stats in (by_hash[h] for h, _ in latest_order(data_dir) if h in by_hash):  # the export's default leads
        if config_hash and stats.config_hash != config_hash:
            continue
        plan, error, wp = None, None, None
        try:
            plan = plan_caps(data_dir, config_hash=stats.config_hash, bootstrap=100, runaway=quality.runaway)
        except PlanError as e:
            error = str(e)
        if plan is not None:
            wp = window_plan(
                data_dir,
                stats.config_hash,
                plan.cap,
                quality.trainer,
                plan.fit,
                quality.runaway,
                candidates=[e.cap for e in plan.estimates],
            )
        answers.append(answer_of(stats, quality, exports, plan, error, wp))
    return answers
