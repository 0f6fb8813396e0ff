"""What a server says of itself, as SGLang 0.5.23's http_server.py reports it, read from the wheel: `/server_info` has
`version` and the launch arguments (`model_path`, `tokenizer_path`, `revision`, `chat_template`: each null unless
given), `/model_info` has `weight_version` ("default" unless set). The emulator says the same, and takes a template
variant and a reported version, so a fleet that differs behind the same model name can be made."""

from __future__ import annotations

import ast

import pytest

from dflash_assets.emulator.config import TEMPLATE_VARIANTS
from tests.support.sglang_wheel import VERSION, function, sglang_dir, tree

pytestmark = pytest.mark.timeout(60)


def _dict_keys(node: ast.AST) -> dict[str, ast.AST]:
    """The constant keys of the first dict literal in `node`, with their values (`**x` under the key None)."""
    found = next(n for n in ast.walk(node) if isinstance(n, ast.Dict))
    return {(k.value if isinstance(k, ast.Constant) else None): v for k, v in zip(found.keys, found.values)}


def _field_default(relative: str, cls: str, name: str):
    """The default of a ServerArgs field declared in arg_groups/fields/ (`name: A[...] = default`)."""
    classes = [n for n in tree(relative).body if isinstance(n, ast.ClassDef) and n.name == cls]
    for stmt in classes[0].body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == name:
            return ast.literal_eval(stmt.value)
    pytest.fail(f"0.5.23's {relative} {cls} has no field {name}")


def test_the_wheels_server_info_is_the_resolved_launch_args_plus_its_version():
    body = _dict_keys(function("entrypoints/http_server.py", "server_info"))
    assert ast.unparse(body["version"]) == "__version__"
    assert ast.unparse(body[None]).startswith("build_server_info(server_args")
    built = ast.unparse(function("utils/common.py", "build_server_info"))
    assert "result = server_args.resolved_dict()" in built
    version_file = (sglang_dir() / "_version.py").read_text()
    assert f"__version__ = version = '{VERSION}'" in version_file


def test_the_wheels_revision_and_chat_template_are_null_unless_given_and_weight_version_default():
    assert _field_default("arg_groups/fields/model.py", "Model", "revision") is None
    assert _field_default("arg_groups/fields/serving.py", "Serving", "chat_template") is None
    assert _field_default("arg_groups/fields/serving.py", "Serving", "tokenizer_path") is None
    assert _field_default("arg_groups/fields/serving.py", "Serving", "weight_version") == "default"
    model_info = _dict_keys(function("entrypoints/http_server.py", "model_info"))
    assert ast.unparse(model_info["weight_version"]).endswith(".config_value('weight_version')")


def test_server_info_reports_version_model_path_and_revision_and_chat_template_null_unless_given(emulator):
    info = emulator().get("/server_info")[1]
    assert info["version"] == VERSION and info["model_path"] == "emulated/qwen3-27b"
    assert info["tokenizer_path"] == "emulated/qwen3-27b"
    assert "revision" in info and info["revision"] is None
    assert "chat_template" in info and info["chat_template"] is None
    given = emulator("--revision", "a1b2c3d", "--chat-template", "qwen3.jinja").get("/server_info")[1]
    assert given["revision"] == "a1b2c3d" and given["chat_template"] == "qwen3.jinja"


def test_model_info_has_the_wheels_keys_and_weight_version_default_unless_set(emulator):
    wheel = set(_dict_keys(function("entrypoints/http_server.py", "model_info"))) - {None}
    status, body = emulator().get("/model_info")
    assert status == 200 and set(body) == wheel
    assert body["weight_version"] == "default"
    assert emulator("--weight-version", "v2").get("/model_info")[1]["weight_version"] == "v2"


def test_a_reported_version_is_said_by_server_info_and_loads(emulator):
    http = emulator("--reported-version", "0.5.24")
    assert http.get("/server_info")[1]["version"] == "0.5.24"
    assert http.get("/v1/loads")[1]["version"] == "0.5.24"


def test_a_template_variant_changes_the_rendered_ids_and_nothing_the_server_reports(emulator):
    probe = {"messages": [{"role": "user", "content": "hi"}]}
    default, other = emulator(), emulator("--template-variant", TEMPLATE_VARIANTS[1])
    assert default.post("/v1/tokenize", probe)[1]["tokens"] != other.post("/v1/tokenize", probe)[1]["tokens"]
    with_system = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]}
    assert default.post("/v1/tokenize", with_system)[1] == other.post("/v1/tokenize", with_system)[1]
    per_process = ("launch_command", "port", "internal_states", "startup_time")
    said = [{k: v for k, v in s.get("/server_info")[1].items() if k not in per_process} for s in (default, other)]
    assert said[0] == said[1]  # the same flags, version and paths: only the rendering tells them apart
