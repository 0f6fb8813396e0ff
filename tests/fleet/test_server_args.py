"""Every flag the builder can emit exists in `sglang serve` 0.5.23, read from the wheel's source.

The wheel is read, never imported (`import sglang` pulls torch). Flags come from two places, as
`ServerArgs.add_cli_args` registers them: the msgspec fields in `srt/arg_groups/fields/*.py`, turned into
flags by `srt/arg_groups/arg_utils.py` (`Arg.cli_name` or `--` + field name with `_` -> `-`, plus
`Arg.aliases`, and `--no-x` for a BooleanOptionalAction; skipped when `no_cli=True` or when the annotation is not `A[T, "help" | Arg(...)]`), and the
literal `parser.add_argument("--...")` calls in `srt/server_args.py` (`--reasoning-parser` among them).
"""

from __future__ import annotations

import argparse
import ast

import pytest

from dflash_assets.fleet.server_args import (
    EMULATOR,
    REMOVED_FLAGS,
    SGLANG_LAUNCH_SERVER,
    SGLANG_SERVE,
    ServerCommand,
    ServerCommandError,
)
from tests.support.sglang_wheel import sglang_dir

# Every typed field set, so that every flag the builder knows is emitted at least once.
EVERY_FIELD = ServerCommand(
    model_path="Qwen/Qwen3-8B",
    served_model_name="qwen3",
    host="127.0.0.1",
    port=30001,
    tp_size=1,
    context_length=16384,
    max_running_requests=40,
    max_mamba_cache_size=200,
    mem_fraction_static=0.85,
    chunked_prefill_size=8192,
    cuda_graph_max_bs_decode=40,
    reasoning_parser="qwen3",
    enable_metrics=True,
    max_queued_requests=512,
    gpus=(1,),
)


def _arg_call(node: ast.expr) -> dict[str, ast.expr] | None:
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Arg":
        return {k.arg: k.value for k in node.keywords}
    return None


def field_flags(source: str) -> set[str]:
    """Flags of the `A[T, ...]` fields of every struct in one fields/*.py module (arg_utils' rules)."""
    flags: set[str] = set()
    for cls in (n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef)):
        for stmt in cls.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            ann = stmt.annotation
            if not (isinstance(ann, ast.Subscript) and getattr(ann.value, "id", None) in ("A", "Annotated")):
                continue  # a plain annotation: no CLI flag from arg_utils (registered by hand, if at all)
            meta = ann.slice.elts[1:] if isinstance(ann.slice, ast.Tuple) else []
            arg = next((a for a in map(_arg_call, meta) if a is not None), None)
            is_help = any(isinstance(m, ast.Constant) and isinstance(m.value, str) for m in meta)
            if arg is None and not is_help:
                continue
            arg = arg or {}
            if "no_cli" in arg and ast.literal_eval(arg["no_cli"]):
                continue
            names = [
                ast.literal_eval(arg["cli_name"]) if "cli_name" in arg else "--" + stmt.target.id.replace("_", "-")
            ]
            names += ast.literal_eval(arg["aliases"]) or [] if "aliases" in arg else []
            if getattr(arg.get("action"), "attr", None) == "BooleanOptionalAction":
                names += ["--no-" + n[2:] for n in names if n.startswith("--")]  # as argparse adds them
            flags.update(names)
    return flags


def add_argument_flags(source: str) -> set[str]:
    """Flags of the literal `parser.add_argument("--x", ...)` calls (server_args.py add_cli_args)."""
    return {
        a.value
        for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.Call) and getattr(n.func, "attr", None) == "add_argument"
        for a in n.args
        if isinstance(a, ast.Constant) and str(a.value).startswith("--")
    }


@pytest.fixture(scope="module")
def sglang_flags() -> set[str]:
    root = sglang_dir() / "srt"
    flags: set[str] = set()
    for path in sorted((root / "arg_groups" / "fields").glob("*.py")):
        flags |= field_flags(path.read_text())
    flags |= add_argument_flags((root / "server_args.py").read_text())
    # A sanity floor: if the extraction silently broke, every check below would pass vacuously.
    assert {"--model-path", "--model", "--port", "--tp-size", "--reasoning-parser"} <= flags, "extraction broke"
    assert len(flags) > 300, f"only {len(flags)} flags extracted from {root}: the extraction is broken"
    return flags


def emitted_flags(args: ServerCommand) -> list[str]:
    return [a for a in args.flags() if a.startswith("--")]


def test_every_flag_the_builder_emits_exists_in_sglang_0_5_23(sglang_flags):
    emitted = emitted_flags(EVERY_FIELD)
    # All typed fields but gpus (CUDA_VISIBLE_DEVICES, not a flag) are exercised.
    assert len(emitted) == len([f for f in ServerCommand.__dataclass_fields__ if f not in ("gpus", "extra_args")])
    # Exact names only: argparse would also take a unique prefix, but one new flag can make it ambiguous.
    missing = [f for f in emitted if f not in sglang_flags]
    assert not missing, f"the builder emits flags that sglang 0.5.23 does not define: {missing}"


def test_the_argv_parses_with_sglang_0_5_23s_flag_set(sglang_flags):
    parser = argparse.ArgumentParser(prog="sglang serve", exit_on_error=False)
    for flag in sorted(sglang_flags):
        parser.add_argument(flag, nargs="?")
    parsed = vars(parser.parse_args(emitted_and_values := EVERY_FIELD.flags()))
    assert parsed["model_path"] == "Qwen/Qwen3-8B" and parsed["context_length"] == "16384", emitted_and_values


def test_cuda_graph_max_bs_is_an_ambiguous_prefix_in_0_5_23(sglang_flags):
    assert "--cuda-graph-max-bs" not in sglang_flags
    matches = sorted(f for f in sglang_flags if f.startswith("--cuda-graph-max-bs"))
    assert matches == ["--cuda-graph-max-bs-decode", "--cuda-graph-max-bs-prefill"]
    assert "--mamba-scheduler-strategy" not in sglang_flags
    assert "--mamba-radix-cache-strategy" in sglang_flags


@pytest.mark.parametrize("flag", sorted(REMOVED_FLAGS))
def test_the_builder_cannot_emit_a_removed_flag(flag):
    assert flag not in emitted_flags(EVERY_FIELD)
    for extra in ([flag, "8"], [f"{flag}=8"]):
        with pytest.raises(ServerCommandError, match="no longer exists in SGLang 0.5.23"):
            ServerCommand(model_path="m", extra_args=extra)


def test_extra_args_may_not_carry_the_key_or_shadow_a_typed_field():
    with pytest.raises(ServerCommandError, match="read from the environment"):
        ServerCommand(model_path="m", extra_args=["--api-key", "sk-secret"])
    with pytest.raises(ServerCommandError, match="--tp sets --tp-size, which is a typed field: set tp_size instead"):
        ServerCommand(model_path="m", extra_args=["--tp", "2"])
    assert ServerCommand(model_path="m", extra_args=["--mamba-ssm-dtype", "bfloat16"]).flags()[-2:] == [
        "--mamba-ssm-dtype",
        "bfloat16",
    ]


def test_the_same_flags_follow_every_launch_command():
    for command in (SGLANG_SERVE, SGLANG_LAUNCH_SERVER, EMULATOR):
        argv = EVERY_FIELD.argv(command)
        assert argv[: len(command)] == list(command) and argv[len(command) :] == EVERY_FIELD.flags()
