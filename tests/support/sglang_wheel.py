"""Where the SGLang 0.5.23 wheel's source is: found without importing it (`import sglang` pulls a CUDA torch);
its generated `/generate` contract, loaded by file path.

`scripts/test.sh` installs the wheel without its dependencies; the contract tests read its files by path.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import importlib.util
from pathlib import Path

import pytest

VERSION = "0.5.23"
INSTALL = f"uv pip install --no-deps sglang=={VERSION}"


def sglang_dir() -> Path:
    """The installed `sglang` package folder; a clear failure when it is missing or another version."""
    spec = importlib.util.find_spec("sglang")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        pytest.fail(f"the sglang {VERSION} wheel is not installed; install it with `{INSTALL}`", pytrace=False)
    version = importlib.metadata.version("sglang")  # the dist-info, no import either
    if version != VERSION:
        pytest.fail(f"sglang {version} is installed, the emulator targets {VERSION}: `{INSTALL}`", pytrace=False)
    return Path(next(iter(spec.submodule_search_locations)))


def sglang_srt() -> Path:
    """`sglang/srt`, where the server's source lives (the paths the reference names are inside it)."""
    return sglang_dir() / "srt"


def generate_api():
    """`sglang/api/v1/api_types.py`, the generated JSON schema the server gates `/generate` with; it needs only
    msgspec, so it is loaded by file path."""
    path = sglang_dir() / "api" / "v1" / "api_types.py"
    spec = importlib.util.spec_from_file_location("sglang_0_5_23_api_types", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sglang_verdict(api, body) -> str | None:
    """What 0.5.23's api_contract.generate_contract_error says about a body."""
    try:
        api.GenerateRequest.from_json_value(body)
    except api.JsonContractError as e:
        return str(e)
    return None


@functools.cache
def tree(relative: str) -> ast.Module:
    return ast.parse((sglang_dir() / "srt" / relative).read_text())


def class_fields(relative: str, name: str) -> set[str]:
    """Annotated fields of a class and of its bases defined in the same module (pydantic / msgspec models)."""
    classes = {n.name: n for n in tree(relative).body if isinstance(n, ast.ClassDef)}
    if name not in classes:
        pytest.fail(f"0.5.23's {relative} has no class {name}")
    node, fields = classes[name], set()
    for stmt in node.body:  # private attributes (_name) are no fields of the JSON
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id[0] != "_":
            fields.add(stmt.target.id)
    for base in node.bases:
        if isinstance(base, ast.Name) and base.id in classes:
            fields |= class_fields(relative, base.id)
    return fields


def function(relative: str, name: str) -> ast.AST:
    found = [
        n for n in ast.walk(tree(relative)) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == name
    ]
    if not found:
        pytest.fail(f"0.5.23's {relative} has no function {name}")
    return found[0]
