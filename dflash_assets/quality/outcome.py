"""What a check returns and how its figures are written for people. The limits it is judged by are
settings.QualitySettings."""

from dataclasses import dataclass

from dflash_assets.settings import Severity

MetadataValue = int | float | str


@dataclass(frozen=True)
class Finding:
    """What one check function found: the verdict, a Markdown summary naming what is wrong, and its figures."""

    passed: bool
    summary_md: str
    metadata: dict[str, MetadataValue]


@dataclass(frozen=True)
class CheckOutcome:
    """A finding stamped with the check's name and severity: the shape Dagster's AssetCheckResult wants."""

    name: str
    passed: bool
    severity: Severity
    summary_md: str
    metadata: dict[str, MetadataValue]
    blocking: bool = False


def pct(rate: float) -> str:
    """A share as a percentage with two decimals: 0.18312 -> '18.31%'."""
    return f"{rate * 100:.2f}%"


def shown(value):
    """A figure as the UI shows it: a share as a percentage (the checks' and reports' only floats are shares and
    thresholds), anything else as it is."""
    return pct(value) if isinstance(value, float) else value


def num(n: int) -> str:
    """A count with thousands separators: 1000 -> '1,000'."""
    return f"{n:,}"


def plural(n: int, noun: str) -> str:
    """'1 row', '1,000 rows': a count with its noun, plural unless one."""
    return f"{num(n)} {noun}" if n == 1 else f"{num(n)} {noun}s"


def share(part: int, whole: int) -> float:
    """part / whole, 0.0 for an empty whole (an empty scope has nothing wrong in it)."""
    return part / whole if whole else 0.0


def config_label(config_hash: str | None, max_output_tokens: int | None) -> str:
    return f"config `{config_hash}` (max_output_tokens {max_output_tokens})"


def verdict(rate: float, limit: float) -> str:
    return f"over the {pct(limit)} threshold" if rate > limit else f"within the {pct(limit)} threshold"


def bullets(lines: list[str], limit: int = 10) -> str:
    """A Markdown list of the first `limit` lines, saying how many more were left out."""
    shown = [f"- {line}" for line in lines[:limit]]
    if len(lines) > limit:
        shown.append(f"- ... and {num(len(lines) - limit)} more")
    return "\n".join(shown)
