"""The emulator's text for output ids (--non-ascii) is what SGLang 0.5.23's own detokenizer code makes of them.

The wheel's `DetokenizerManager` methods, `DecodeStatus`, `find_printable_text` and `Req.init_incremental_detokenize`
are read from its source by AST and run here, driven step by step as the scheduler drives them, with the emulator's
tokenizer; the emulator's port (emulator/detokenizer.py) must send the same strings at every step.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import typing
from collections import defaultdict
from types import SimpleNamespace

import pytest

from dflash_assets.emulator import detokenizer, model
from dflash_assets.emulator import tokenizer as tok
from tests.support.sglang_wheel import sglang_dir, sglang_srt

LENGTHS = model.LengthModel()


def _pick(tree: ast.Module, names: set[str], cls: str | None = None) -> list[ast.stmt]:
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body if cls else tree.body
    found = [n for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in names]
    assert {n.name for n in found} == names, f"the wheel no longer has {names - {n.name for n in found}}"
    return found


@pytest.fixture(scope="module")
def wheel():
    """The wheel's detokenizer pieces, executed from its source (importing sglang would pull torch)."""
    srt = sglang_srt()
    manager = ast.parse((srt / "managers" / "detokenizer_manager.py").read_text())
    batch = ast.parse((srt / "managers" / "schedule_batch.py").read_text())
    utils = ast.parse((sglang_dir() / "utils.py").read_text())
    methods = _pick(
        manager,
        {"trim_matched_stop", "_clamp_decode_ids", "_grouped_batch_decode", "_decode_batch_token_id_output"},
        "DetokenizerManager",
    )
    req_methods = _pick(batch, {"init_incremental_detokenize"}, "Req")
    module = ast.Module(
        body=[
            *_pick(manager, {"DecodeStatus"}),
            *_pick(utils, {"_is_chinese_char", "find_printable_text"}),
            ast.ClassDef(name="Detokenizer", bases=[], keywords=[], body=methods, decorator_list=[], type_params=[]),
            ast.ClassDef(name="Req", bases=[], keywords=[], body=req_methods, decorator_list=[], type_params=[]),
        ],
        type_ignores=[],
    )
    ns = {
        "dataclasses": dataclasses,
        "defaultdict": defaultdict,
        "DETOKENIZER_MAX_STATES": 1 << 16,
        **{name: getattr(typing, name) for name in ("Dict", "List", "Optional", "Tuple", "Union")},
    }
    offset = next(
        n.value.value
        for n in batch.body
        if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == "INIT_INCREMENTAL_DETOKENIZATION_OFFSET"
    )
    ns["INIT_INCREMENTAL_DETOKENIZATION_OFFSET"] = offset
    exec(compile(ast.fix_missing_locations(module), "sglang-0.5.23-detokenizer", "exec"), ns)
    return ns


class _Tokenizer:
    """The emulator's tokenizer behind the Hugging Face calls the detokenizer makes."""

    is_fast = True

    def batch_decode(self, ids_list, skip_special_tokens=True, spaces_between_special_tokens=True):
        return [tok.decode(ids, skip_special_tokens=skip_special_tokens) for ids in ids_list]


def wheel_output_strs(ns, input_ids, output_ids, steps, finish, skip=True) -> list[str]:
    """What the wheel's detokenizer sends at each step, fed as the scheduler's output streamer feeds it."""
    manager = ns["Detokenizer"]()
    manager.__dict__.update(
        decode_status={},
        vocab_size=tok.VOCAB_SIZE,
        disable_tokenizer_batch_decode=False,
        tokenizer=_Tokenizer(),
        tool_close_token_ids=set(),
        is_tool_call_parser_gpt_oss=False,
    )
    req = ns["Req"]()
    req.__dict__.update(origin_input_ids_unpadded=list(input_ids), surr_offset=None, read_offset=None)
    sent_ids, out = 0, []
    for i, k in enumerate(steps):
        req.output_ids_through_stop = list(output_ids[:k])
        decode_ids, read_offset = req.init_incremental_detokenize()
        recv = SimpleNamespace(
            rids=["r"],
            decoded_texts=[""],
            decode_ids=[decode_ids[sent_ids:]],
            read_offsets=[read_offset],
            finished_reasons=[finish if i == len(steps) - 1 else None],
            no_stop_trim=[False],
            skip_special_tokens=[skip],
            spaces_between_special_tokens=[True],
        )
        sent_ids = len(decode_ids)
        out += manager._decode_batch_token_id_output(recv)
    return out


def chat_ids(text: str) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


def cut_in_a_dash(prompt: list[int], into: int) -> tuple[model.Generation, int]:
    """The whole non-ASCII completion and a cap that keeps `into` of the 3 bytes of its first em dash."""
    full = model.generate(model.plan_completion(prompt, LENGTHS, non_ascii=True), 1 << 20)
    return full, full.output_ids.index("\u2014".encode()[0]) + into


@pytest.mark.parametrize("into", [1, 2])
def test_a_reply_cut_inside_a_character_ends_in_one_replacement_character_as_sglang_sends_it(wheel, into):
    prompt = chat_ids("Explain idea 7 step by step.")
    _, cap = cut_in_a_dash(prompt, into)
    parent = model.generate(model.plan_completion(prompt, LENGTHS, non_ascii=True), cap)
    steps = detokenizer.non_streamed_steps(cap)
    mine = detokenizer.output_strs(prompt, parent.output_ids, steps, parent.finish)
    assert mine == wheel_output_strs(wheel, prompt, parent.output_ids, steps, parent.finish)
    text = "".join(mine)
    # the space before the dash, then the dash's 1 or 2 bytes (an incomplete lead: one U+FFFD)
    assert text.endswith(" \ufffd") and text.count("\ufffd") == 1 and "\u2014" not in text[-2:]


@pytest.mark.parametrize("into", [1, 2])
def test_a_continuation_from_inside_a_character_sends_text_without_it(wheel, into):
    """The surrounding prompt ids end in U+FFFD; the completed character takes that one place: it is cut off."""
    prompt = chat_ids("Explain idea 7 step by step.")
    full, cap = cut_in_a_dash(prompt, into)
    carried = prompt + full.output_ids[:cap]
    rest = model.generate(model.plan_completion(carried, LENGTHS, non_ascii=True), 120)
    assert full.output_ids[cap : cap + 120] == rest.output_ids
    steps = detokenizer.non_streamed_steps(len(rest.output_ids))
    mine = detokenizer.output_strs(carried, rest.output_ids, steps, rest.finish)
    assert mine == wheel_output_strs(wheel, carried, rest.output_ids, steps, rest.finish)
    text = "".join(mine)
    alone = tok.decode(rest.output_ids, skip_special_tokens=True)
    assert alone.startswith("\ufffd" * (3 - into) + " ")  # decoded alone: one U+FFFD per stray byte
    assert "\ufffd" not in text and text == alone.lstrip("\ufffd"), "the dash is on neither side of the joint"


@pytest.mark.parametrize("stream_step", [1, 7, 32])
def test_streamed_steps_send_what_sglang_sends_and_hold_back_a_cut_character(wheel, stream_step):
    prompt = chat_ids("Explain idea 7 step by step.")
    full, dash = cut_in_a_dash(prompt, 0)
    ids = full.output_ids[: dash + 200]
    g = model.generate(model.plan_completion(prompt, LENGTHS, non_ascii=True), len(ids))
    steps = [1, *range(1 + stream_step, len(ids), stream_step), len(ids)]
    mine = detokenizer.output_strs(prompt, g.output_ids, steps, g.finish)
    assert mine == wheel_output_strs(wheel, prompt, g.output_ids, steps, g.finish)
    assert "".join(mine) == g.text and "\ufffd" not in "".join(mine)  # held back, then sent whole


def test_a_finished_reply_at_its_end_of_sequence_trims_the_stop_token_as_sglang_does(wheel):
    prompt = chat_ids("a short one")
    g = model.generate(
        model.plan_completion(prompt, model.LengthModel(median=120, sigma=0.01), non_ascii=True), 1 << 20
    )
    assert g.finish["type"] == "stop" and "\u2014" in g.text
    for skip in (True, False):
        steps = detokenizer.non_streamed_steps(len(g.output_ids))
        mine = detokenizer.output_strs(prompt, g.output_ids, steps, g.finish, skip)
        assert mine == wheel_output_strs(wheel, prompt, g.output_ids, steps, g.finish, skip)
        assert "".join(mine) == g.text


def test_the_constants_are_the_wheels():
    batch = (sglang_srt() / "managers" / "schedule_batch.py").read_text()
    assert re.search(rf"^INIT_INCREMENTAL_DETOKENIZATION_OFFSET = {detokenizer.SURROUNDING_IDS}$", batch, re.M)
    environ = (sglang_srt() / "environ.py").read_text()
    assert re.search(rf"SGLANG_FORCE_STREAM_INTERVAL = EnvInt\({detokenizer.FORCE_STREAM_INTERVAL}\)", environ)
    streamer = (sglang_srt() / "managers" / "scheduler_components" / "output_streamer.py").read_text()
    assert "len(req.output_ids) % self.default_force_stream_interval == 0" in streamer


def test_the_server_answers_and_streams_with_the_detokenizers_text(emulator):
    """Over HTTP (--non-ascii): a reply cut inside a character ends in U+FFFD; its continuation answers without
    the character, and streamed, its first token (the rest of the character) shows nothing until more follow."""
    server = emulator("--non-ascii", "--decode-tokens-per-s", "0")
    prompt = chat_ids("Explain idea 7 step by step.")
    full, cap = cut_in_a_dash(prompt, 1)
    status, cut = server.post("/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": cap}})
    assert status == 200 and cut["output_ids"] == full.output_ids[:cap] and cut["text"].endswith(" \ufffd")
    carried = {"input_ids": prompt + full.output_ids[:cap], "sampling_params": {"max_new_tokens": 300}}
    status, rest = server.post("/generate", carried)
    assert status == 200 and rest["output_ids"] == full.output_ids[cap : cap + 300]
    assert rest["text"] == tok.decode(rest["output_ids"]).lstrip("\ufffd"), "the dash is not in the new text"
    status, events = server.sse("/generate", {**carried, "stream": True})
    chunks = [(len(e["output_ids"]), e["text"]) for e in events if e != "[DONE]"]
    assert status == 200 and chunks[0] == (1, "") and chunks[-1] == (300, rest["text"])
