"""The layers run one way: rules < settings < store < fleet < generation < quality < defs < cli, with the emulator
apart (only defs/ and cli/ import it; it imports nothing of the pipeline but rules and settings), and no two modules
import each other, however far round. demo/ holds the bundled prompts (and the script that made them): it imports
nothing of the pipeline, nor does anything import it. Every import is read, those inside functions too."""

import ast
from pathlib import Path

import dflash_assets

PACKAGE = Path(dflash_assets.__file__).resolve().parent
ORDER = ["rules", "settings", "store", "fleet", "generation", "quality", "defs", "cli"]
LAYER = {name: i for i, name in enumerate(ORDER)} | {"definitions": ORDER.index("defs")}  # the one `defs`
EMULATOR_USERS = {"defs", "cli", "definitions"}
EMULATOR_USES = {"rules", "settings", "emulator"}


def module_of(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path) -> dict[str, Path]:
    return {module_of(p, root): p for p in sorted(root.rglob("*.py"))}


def imports(path: Path, module: str, known: set[str]) -> set[str]:
    """Every module of the package that `path` imports, anywhere in it (a name imported from a package that is
    one of its modules counts as that module)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            submodules = {f"{base}.{alias.name}" for alias in node.names} & known
            # `from pkg import mod`: an arrow to the module; any other name is the package's own
            found |= submodules if len(submodules) == len(node.names) else {base, *submodules}
    return {name for name in found if name in known and name != module}


def part(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def violations(root: Path) -> list[str]:
    """Every arrow against the order, every import of or by the emulator it may not make, every circle."""
    known = modules(root)
    graph = {m: imports(p, m, set(known)) for m, p in known.items()}
    wrong = []
    for importer, imported in sorted((a, b) for a, bs in graph.items() for b in bs):
        here, there = part(importer), part(imported)
        if here == there or "" in (here, there):
            continue
        if "demo" in (here, there):
            wrong.append(f"{importer} imports {imported}: demo/ holds the bundled prompts, apart from every layer")
        elif there == "emulator" and here not in EMULATOR_USERS:
            wrong.append(f"{importer} imports the emulator ({imported}): only defs/ and cli/ may")
        elif here == "emulator" and there not in EMULATOR_USES:
            wrong.append(f"the emulator ({importer}) imports {imported}: it may use only rules and settings")
        elif here in LAYER and there in LAYER and LAYER[there] > LAYER[here]:
            wrong.append(f"{importer} ({here}) imports {imported} ({there}), a layer above it")
    wrong += [f"a circle: {' -> '.join([*circle, circle[0]])}" for circle in circles(graph)]
    return wrong


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each in name order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_every_layer_is_one_of_the_order():
    parts = {part(m) for m in modules(PACKAGE)} - {""}
    assert parts <= set(LAYER) | {"emulator", "demo"}, f"a part of the package in no layer: {parts - set(LAYER)}"


def test_demo_holds_the_bundled_prompts_only():
    assert sorted(p.name for p in (PACKAGE / "demo").iterdir() if p.name != "__pycache__") == [
        "__init__.py",
        "agentic.jsonl",
        "make_agentic.py",
        "make_prompts.py",
        "prompts.jsonl",
    ]


def test_no_import_runs_against_the_layers_and_no_two_modules_import_each_other():
    wrong = violations(PACKAGE)
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_function_level_imports_arrows_against_the_order_and_circles(tmp_path):
    root = tmp_path / "dflash_assets"
    for name, text in {
        "__init__.py": "",
        "settings.py": "",
        "generation/__init__.py": "",
        "generation/send.py": "def f():\n    from dflash_assets.quality.runaway import is_runaway\n",
        "quality/__init__.py": "",
        "quality/runaway.py": "from ..generation import send\n",
        "fleet/__init__.py": "",
        "fleet/fleet.py": "from dflash_assets.emulator import process\n",
        "emulator/__init__.py": "",
        "emulator/process.py": "from dflash_assets import settings\n",
    }.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    assert violations(root) == [
        "dflash_assets.fleet.fleet imports the emulator (dflash_assets.emulator.process): only defs/ and cli/ may",
        "dflash_assets.generation.send (generation) imports dflash_assets.quality.runaway (quality), a layer above it",
        "a circle: dflash_assets.generation.send -> dflash_assets.quality.runaway -> dflash_assets.generation.send",
    ]
