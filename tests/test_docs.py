"""The docs stay true to the code: their links resolve, and the figures they state about the code (how many checks,
which of them block, the CLI's commands) are read from the registry and the parser, not remembered."""

import re
from pathlib import Path

from dflash_assets.quality.checks.registry import CHECKS
from tests.support.cli import cli_commands

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted(
    [
        ROOT / "README.md",
        *(ROOT / "docs").glob("*.md"),
        ROOT / "benchmarks" / "README.md",
        ROOT / "deploy" / "README.md",
        ROOT / "scripts" / "README.md",
    ]
)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def prose(path: Path) -> str:
    """The file without its fenced code blocks (a `#` there is a shell comment, a `[x](y)` is not a link)."""
    return re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", prose(path), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def leaf_commands() -> list[tuple[str, ...]]:
    """The commands that run something: `fleet up` but not `fleet` alone, which only groups them."""
    commands = cli_commands()
    return sorted(c for c in commands if c and not any(o[: len(c)] == c and o != c for o in commands))


def listed_commands(found: list[tuple[str, str]]) -> list[tuple[str, ...]]:
    """What a doc lists, as (verb, word after it): the word is a subcommand only where the parser has it."""
    commands = set(cli_commands())
    return sorted({(verb, sub) if (verb, sub) in commands else (verb,) for verb, sub in found})


def test_every_relative_link_in_the_docs_resolves_to_a_file_and_its_anchor():
    broken, checked = [], 0
    for doc in DOCS:
        for target in LINK.findall(prose(doc)):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            checked += 1
            file, _, anchor = target.partition("#")
            path = (doc.parent / file).resolve() if file else doc
            if not path.is_file():
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no file {file})")
            elif anchor and anchor not in anchors(path):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no heading #{anchor} in {path.name})")
    assert not broken, "broken links:\n" + "\n".join(broken)
    assert checked > 20  # the README's map alone links every doc


def test_the_docs_state_the_registrys_number_of_checks_and_of_blocking_checks():
    blocking = sum(spec.blocking for spec in CHECKS)
    stated = []
    for doc in DOCS:
        text = doc.read_text()
        for n in re.findall(r"\b(\d+) (?:quality )?checks\b", text):
            stated.append((doc.name, "checks", int(n), len(CHECKS)))
        for n in re.findall(r"\b(\d+)(?: of them)? blocking\b", text):
            stated.append((doc.name, "blocking", int(n), blocking))
    wrong = [s for s in stated if s[2] != s[3]]
    assert not wrong, f"(doc, what, stated, registry): {wrong}"
    assert {what for _, what, _, _ in stated} == {"checks", "blocking"}  # the README's diagram states both


def test_the_quality_gate_lists_every_check_of_the_registry_under_its_blocking_or_warning_heading():
    text = (ROOT / "docs" / "quality-gate.md").read_text()
    blocking_part, _, warning_part = text.partition("\nWarnings:\n")
    blocking_part = blocking_part.partition("\nBlocking:\n")[2]
    warning_part = warning_part.partition("\n## ")[0]
    listed = lambda part: re.findall(r"^- `(\w+)`", part, flags=re.M)  # noqa: E731
    assert sorted(listed(blocking_part)) == sorted(s.name for s in CHECKS if s.blocking)
    assert sorted(listed(warning_part)) == sorted(s.name for s in CHECKS if not s.blocking)


def test_the_readme_lists_exactly_the_parsers_commands():
    rows = re.findall(r"^\| `dflash (\w+)(?: (\w+))?`", (ROOT / "README.md").read_text(), flags=re.M)
    assert listed_commands(rows) == leaf_commands()


def test_the_running_doc_describes_every_command_of_the_parser():
    text = (ROOT / "docs" / "running.md").read_text().partition("## From a terminal")[2].partition("\n## ")[0]
    items = re.findall(r"^- `dflash (\w+)(?: (\w+))?", text, flags=re.M)
    assert listed_commands(items) == leaf_commands()


def test_no_doc_line_is_wider_than_120_characters():
    wide = [
        f"{doc.relative_to(ROOT)}:{n}"
        for doc in DOCS
        for n, line in enumerate(doc.read_text().splitlines(), 1)
        if len(line) > 120
    ]
    assert not wide, wide


def section(path: Path, heading: str) -> str:
    """The text under `## heading`, up to the next heading of its level."""
    text = prose(path)
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]


def test_the_settings_doc_counts_the_quality_limits_and_lists_every_field_of_the_completions_run_config():
    from dflash_assets.defs.completions.assets import CompletionsConfig
    from dflash_assets.settings import Deployment, EnvSetting, QualitySettings

    doc = ROOT / "docs" / "settings.md"
    limits = [n for n in QualitySettings.model_fields if n.endswith(("_max", "_percentile"))]
    assert f"({len(limits)} rates and percentiles" in re.sub(r"\s+", " ", prose(doc))
    for heading, fields in (
        ("`completions` run config", CompletionsConfig.model_fields),
        ("`quality` resource", QualitySettings.model_fields),
    ):
        listed = set(re.findall(r"`(\w+)`", section(doc, heading)))
        assert not set(fields) - listed, f"{heading}: not listed: {sorted(set(fields) - listed)}"
    variables = [s.name for s in vars(Deployment).values() if isinstance(s, EnvSetting)]
    table = set(re.findall(r"^\| `(\w+)` \|", section(doc, "Environment variables"), flags=re.M))
    assert not set(variables) - table, f"environment variables not in the table: {set(variables) - table}"


def test_the_readme_is_a_front_door_with_your_own_prompts_on_its_first_screen():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) < 130, len(lines)
    assert any("--prompts" in line for line in lines[:60])
    assert (
        "<!-- test-command: .ci/run runs the next line verbatim -->\n```bash\nbash scripts/test.sh\n```"
        in "\n".join(lines)
    )


def test_the_docs_describe_the_product_not_the_history_of_its_measurements():
    said = re.compile(r"\b(this round|last round|this machine|other engineers|our machine)\b", re.I)
    found = [
        f"{doc.relative_to(ROOT)}: {m.group(0)!r}"
        for doc in DOCS
        for m in said.finditer(" ".join(doc.read_text().split()))  # a phrase broken over two lines too
    ]
    assert not found, found
