"""The house in figures, read from the code (no import of it): lines, functions over 80 lines or with more than 8
parameters, dict reads of our own rows (`row["..."]` outside SQL), and package modules with no test file beside them.

`uv run python scripts/house.py` prints them; scripts/test.sh prints them before the tests, so every CI run records
them. `--strict` exits 1 when a limit is passed (none yet does: the figures are what the work is measured by).
"""

import argparse
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "dflash_assets"
LONGEST, MOST_PARAMETERS = 80, 8
# a read of one of our own rows by its column's name: row["prompt_id"], r['turn'], rec["config_hash"]
ROW_READ = re.compile(r"\b(row|r|rec|record|first|last|turn_row|prev|previous)\[\s*['\"][a-z_]+['\"]\s*\]")
# modules tested through another one's tests: the module, and the test file that exercises it (through the
# command, the server or the asset that uses it)
TESTED_THROUGH = {
    "cli/environment.py": "tests/cli/test_front_door.py",
    "cli/errors.py": "tests/cli/test_mistakes.py",
    "cli/fleet.py": "tests/cli/test_commands.py",
    "cli/generate.py": "tests/cli/test_probe.py",
    "cli/parser.py": "tests/cli/test_commands.py",
    "cli/probe_summary.py": "tests/cli/test_probe.py",
    "cli/render.py": "tests/cli/test_terminal.py",
    "cli/shards.py": "tests/cli/test_answer.py",
    "defs/completions/jobs.py": "tests/defs/test_definitions.py",
    "defs/continuation/jobs.py": "tests/defs/test_definitions.py",
    "defs/quality/jobs.py": "tests/defs/test_definitions.py",
    "defs/training/jobs.py": "tests/defs/test_definitions.py",
    "defs/sensors.py": "tests/defs/test_source_guard.py",
    "emulator/contract.py": "tests/emulator/test_sglang_contract.py",
    "emulator/engine.py": "tests/emulator/test_scheduling.py",
    "emulator/info.py": "tests/emulator/test_http.py",
    "emulator/native.py": "tests/emulator/test_http.py",
    "emulator/openai.py": "tests/emulator/test_http.py",
    "emulator/responses.py": "tests/emulator/test_sglang_contract.py",
    "emulator/scheduler.py": "tests/emulator/test_scheduling.py",
    "emulator/server.py": "tests/emulator/test_http.py",
    "emulator/state.py": "tests/emulator/test_faults.py",
    "emulator/tokenizer.py": "tests/emulator/test_model.py",
    "fleet/membership.py": "tests/engines/test_gateway_membership.py",
    "fleet/processes.py": "tests/fleet/test_launch.py",
    "fleet/registry.py": "tests/fleet/test_launch.py",
    "fleet/supervise.py": "tests/cli/test_launch_quarantine.py",
    "generation/dedupe.py": "tests/generation/test_repeats.py",
    "generation/stopping.py": "tests/generation/test_runaway_early_stop.py",
    "generation/turns.py": "tests/generation/test_all_turns.py",
    "quality/checks/accounting.py": "tests/quality/checks/test_gate.py",
    "quality/checks/content.py": "tests/quality/checks/test_checks.py",
    "quality/checks/context.py": "tests/quality/checks/test_checks.py",
    "quality/checks/integrity.py": "tests/quality/checks/test_checks.py",
    "quality/checks/rates.py": "tests/quality/checks/test_checks.py",
    "quality/checks/tools.py": "tests/generation/test_agentic_source.py",
    "quality/outcome.py": "tests/quality/checks/test_checks.py",
    "quality/report/probe_advice.py": "tests/cli/test_probe.py",
    "quality/report/pictures.py": "tests/quality/report/test_report.py",
    "quality/report/rejects.py": "tests/cli/test_answer.py",
    "quality/training/selection.py": "tests/quality/training/test_conversation_export.py",
    "quality/training/trainer_settings.py": "tests/quality/training/test_held_out.py",
    "quality/training/writers.py": "tests/quality/training/test_export.py",
}


def python_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "demo" not in p.relative_to(PACKAGE).parts)


def is_parser_declaration(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """argparse declarations (a function that is mostly add_argument calls) are long by nature, and exempt."""
    calls = [n for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
    adds = sum(1 for c in calls if isinstance(c.func, ast.Attribute) and c.func.attr == "add_argument")
    return adds >= 5 and adds * 2 >= len(calls) // 2


def functions(path: Path) -> list[tuple[str, int, int]]:
    """(qualified name, lines, parameters) of every function in `path`."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not is_parser_declaration(node):
            args = node.args
            names = [a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs] if a.arg not in {"self", "cls"}]
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            found.append((f"{path.relative_to(ROOT)}:{node.lineno} {node.name}", length, len(names)))
    return found


def row_reads(path: Path) -> int:
    """`row["column"]` reads outside SQL strings: a string literal's own text is not code."""
    source = path.read_text()
    strings = [
        (n.lineno, n.end_lineno)
        for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.end_lineno and n.end_lineno > n.lineno
    ]
    count = 0
    for number, line in enumerate(source.splitlines(), 1):
        if any(a < number < b for a, b in strings):
            continue
        count += len(ROW_READ.findall(line))
    return count


def untested(files: list[Path]) -> list[str]:
    """Package modules with no test file of their name (test_<module>.py anywhere under tests/), no test that
    imports them by their dotted path, and no entry in TESTED_THROUGH naming a test file that exists."""
    tests = list((ROOT / "tests").rglob("test_*.py"))
    test_names = {p.stem.removeprefix("test_") for p in tests}
    imported = "\n".join(p.read_text() for p in tests)
    missing = []
    for path in files:
        if path.stem in {"__init__", "__main__"} or path.stem in test_names:
            continue
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        through = TESTED_THROUGH.get(str(path.relative_to(PACKAGE)))
        if re.search(rf"\b{re.escape(module)}\b", imported) or (through and (ROOT / through).exists()):
            continue
        missing.append(str(path.relative_to(ROOT)))
    return missing


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strict", action="store_true", help="exit 1 when a figure passes its limit")
    parser.add_argument("--list", action="store_true", help="name every function, read and module counted")
    args = parser.parse_args()
    files = python_files(PACKAGE)
    lines = sum(len(p.read_text().splitlines()) for p in files)
    fns = [f for p in files for f in functions(p)]
    long_ = sorted((f for f in fns if f[1] > LONGEST), key=lambda f: -f[1])
    wide = sorted((f for f in fns if f[2] > MOST_PARAMETERS), key=lambda f: -f[2])
    reads = {str(p.relative_to(ROOT)): row_reads(p) for p in files}
    missing = untested(files)
    print(f"house: {lines:,} lines in {len(files)} modules under dflash_assets/ (the bundled prompts aside)")
    print(
        f"house: {len(long_)} functions over {LONGEST} lines (argparse declarations aside), longest: "
        + ", ".join(f"{name.split(' ')[1]} {n}" for name, n, _ in long_[:3])
    )
    print(
        f"house: {len(wide)} functions with more than {MOST_PARAMETERS} parameters, most: "
        + ", ".join(f"{name.split(' ')[1]} {n}" for name, _, n in wide[:3])
    )
    print(f"house: {sum(reads.values())} dict reads of our own rows (row[\"...\"] outside SQL)")
    print(f"house: {len(missing)} modules with no test file and no test that imports them")
    if args.list:
        for name, n, p in long_ + wide:
            print(f"  {name}: {n} lines, {p} parameters")
        for path, n in sorted(reads.items(), key=lambda kv: -kv[1]):
            if n:
                print(f"  {path}: {n} row reads")
        for path in missing:
            print(f"  untested: {path}")
    failed = args.strict and (long_ or wide or any(reads.values()) or missing)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
