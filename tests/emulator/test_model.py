"""The emulator's stand-in model: tokenizer, chat template, deterministic and
autoregressive-consistent completions, output length distribution."""

from __future__ import annotations

import json
import random
import time

import pytest

from dflash_assets.emulator import model
from dflash_assets.emulator import tokenizer as tok

LENGTHS = model.LengthModel()


def chat_ids(text: str, thinking: bool = True) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], enable_thinking=thinking))


@pytest.mark.parametrize(
    "text",
    [
        "",
        "plain words here",
        "Héllo wörld, 你好 🙂!",
        "tabs\tand\n\n\nnewlines  two spaces",
        "<|im_start|>user\nhi<|im_end|>\n<think>x</think>",
        "lone \ud800 surrogate",
        "1234 (x+y)=z; ok?",
    ],
)
def test_decode_inverts_encode_for_any_string(text):
    assert tok.decode(tok.encode(text)) == text


def test_special_tokens_are_single_ids():
    ids = tok.encode("<|im_start|><|im_end|><think></think><|endoftext|>")
    assert ids == [tok.IM_START_ID, tok.IM_END_ID, tok.THINK_ID, tok.THINK_END_ID, tok.ENDOFTEXT_ID]


def test_unknown_words_fall_back_to_bytes():
    assert tok.encode("zzqx") == list(b"zzqx")


def fastest(run, repeat: int = 7) -> float:
    """The least CPU time of this thread over `repeat` runs: the cost of the work. Not wall time, which other
    processes on a busy machine stretch (a 4x ratio once measured 10x under a load of 3.7 on 2 cores)."""
    times = []
    for _ in range(repeat):
        t = time.thread_time()
        run()
        times.append(time.thread_time() - t)
    return min(times)


def test_encoding_cost_grows_linearly_with_the_prompt():
    # ratios of costs measured side by side, not milliseconds: the absolute speed is the engine benchmark's
    rng = random.Random(0)
    encode = tok._encode_cached.__wrapped__  # bypass the cache
    short, long = (" ".join(rng.choice(tok.WORDS) for _ in range(n)) for n in (4000, 16000))
    assert len(encode(short)) == 4000 and len(encode(long)) == 16000
    ratio = fastest(lambda: encode(long)) / fastest(lambda: encode(short))
    assert ratio < 10, f"4x the prompt cost {ratio:.1f}x the time: not linear (quadratic would be 16x)"


def test_chat_template_is_qwen35_style():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(msgs) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )
    assert tok.apply_chat_template(msgs, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert tok.apply_chat_template(msgs, add_generation_prompt=False).endswith("Hi<|im_end|>\n")


def test_the_chat_template_renders_thinking_and_history_as_qwen3_documents_it():
    """Qwen3's template: the answer after the last user turn is `<think>\\n` + reasoning.strip('\\n') +
    `\\n</think>\\n\\n` + content.lstrip('\\n'); an earlier answer keeps its content only (its reasoning, given
    as reasoning_content or inside the content before `</think>`, is dropped); a request's prompt is unchanged."""
    history = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "\nthought one\n"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "<think>\nthought two\n</think>\n\na2"},
        {"role": "user", "content": "q3"},
    ]
    prompt = tok.apply_chat_template(history)
    assert prompt == (
        "<|im_start|>user\nq1<|im_end|>\n<|im_start|>assistant\na1<|im_end|>\n<|im_start|>user\nq2<|im_end|>\n"
        "<|im_start|>assistant\na2<|im_end|>\n<|im_start|>user\nq3<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )
    answered = [*history, {"role": "assistant", "content": "\n\na3", "reasoning_content": "thought three"}]
    rendered = tok.apply_chat_template(answered, add_generation_prompt=False)
    assert rendered == prompt.removesuffix("<think>\n") + "<think>\nthought three\n</think>\n\na3<|im_end|>\n"
    # a reasoning that already ends with newlines gets exactly one before </think>; none at all, an empty block
    for reasoning, block in (("r\n\n", "<think>\nr\n</think>\n\n"), (None, "<think>\n\n</think>\n\n")):
        last = {"role": "assistant", "content": "a", "reasoning_content": reasoning}
        text = tok.apply_chat_template([{"role": "user", "content": "q"}, last], add_generation_prompt=False)
        assert text == f"<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n{block}a<|im_end|>\n"


def test_completion_is_a_function_of_the_prompt():
    a = model.generate(model.plan_completion(chat_ids("alpha"), LENGTHS), 1 << 20)
    b = model.generate(model.plan_completion(chat_ids("alpha"), LENGTHS), 1 << 20)
    c = model.generate(model.plan_completion(chat_ids("beta"), LENGTHS), 1 << 20)
    assert a == b
    assert a.output_ids != c.output_ids


def test_sampling_seed_changes_the_completion():
    ids = chat_ids("alpha")
    assert model.plan_completion(ids, LENGTHS, 1) != model.plan_completion(ids, LENGTHS, 2)
    assert model.plan_completion(ids, LENGTHS, 1) == model.plan_completion(ids, LENGTHS, 1)


def test_thinking_completion_is_reasoning_then_answer_then_im_end():
    plan = model.plan_completion(chat_ids("question"), LENGTHS)
    g = model.generate(plan, 1 << 20)
    assert plan.thinking and g.finish == {"type": "stop", "matched": tok.IM_END_ID}
    assert len(g.output_ids) == plan.total and g.output_ids[-1] == tok.IM_END_ID
    assert g.output_ids[plan.reasoning] == tok.THINK_END_ID
    reasoning, _, answer = g.text.partition("</think>")
    assert reasoning.strip() and answer.startswith("\n\n") and answer.strip()
    assert model.count_reasoning_tokens(g.output_ids) == plan.reasoning + 1


def test_non_thinking_completion_has_no_reasoning():
    plan = model.plan_completion(chat_ids("question", thinking=False), LENGTHS)
    g = model.generate(plan, 1 << 20)
    assert not plan.thinking and tok.THINK_END_ID not in g.output_ids and "</think>" not in g.text


def test_a_cap_truncates_with_finish_reason_length():
    plan = model.plan_completion(chat_ids("question"), LENGTHS)
    g = model.generate(plan, 10)
    assert len(g.output_ids) == 10 and g.finish == {"type": "length", "length": 10}


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("k,m", [(1, 5), (37, 100), (500, 4000), (2000, 1 << 20)])
def test_continuing_a_truncated_output_equals_generating_with_a_larger_cap(thinking, k, m):
    prompt = chat_ids(f"continue me {k}", thinking)
    full = model.generate(model.plan_completion(prompt, LENGTHS), 1 << 20)
    first = model.generate(model.plan_completion(prompt, LENGTHS), k)
    rest = model.generate(model.plan_completion(prompt + first.output_ids, LENGTHS), m)
    assert first.output_ids + rest.output_ids == full.output_ids[: k + m] or (
        k >= len(full.output_ids)  # nothing left to continue
    )
    if k + m >= len(full.output_ids) > k:
        assert rest.finish == full.finish


def test_continuing_from_text_equals_continuing_from_ids():
    """Outputs re-tokenise to their own ids, so prompt text + output text works too."""
    text = tok.apply_chat_template([{"role": "user", "content": "text path"}])
    prompt = tok.encode(text)
    first = model.generate(model.plan_completion(prompt, LENGTHS), 300)
    assert tok.encode(text + first.text) == prompt + first.output_ids
    again = model.generate(model.plan_completion(tok.encode(text + first.text), LENGTHS), 50)
    assert again.output_ids == model.generate(model.plan_completion(prompt, LENGTHS), 350).output_ids[300:]


def test_last_generation_prompt_marks_where_output_starts():
    history = [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "earlier answer"},
        {"role": "user", "content": "second"},
    ]
    plan = model.plan_completion(tok.encode(tok.apply_chat_template(history)), LENGTHS)
    assert plan.resume_at == 0 and plan.thinking


def test_truncation_share_at_4096_with_defaults_is_15_to_20_percent():
    rng = random.Random(7)
    n, cut = 3000, 0
    for i in range(n):
        words = " ".join(rng.choice(tok.WORDS) for _ in range(rng.randint(5, 80)))
        cut += model.generate(model.plan_completion(chat_ids(f"{words} {i}"), LENGTHS), 4096).finish["type"] == "length"
    assert 0.15 <= cut / n <= 0.20


def test_building_a_16kb_reply_costs_less_than_serialising_it():
    lengths = model.LengthModel(median=2800, sigma=0.01)
    g = model.generate(model.plan_completion(chat_ids("long"), lengths), 1 << 20)
    assert len(g.text.encode()) > 15_000
    build = fastest(lambda: model.generate(model.plan_completion(chat_ids("long"), lengths), 1 << 20))
    serialise = fastest(lambda: json.dumps({"text": g.text, "output_ids": g.output_ids}))
    assert build < serialise, (build, serialise)  # the server JSON-encodes every reply anyway


# ---- --non-ascii: em dashes as byte tokens, so a cap can cut a character ----------


def test_the_default_stream_is_ascii_and_unchanged_by_the_non_ascii_mode():
    """Other tests compare outputs row for row: the ASCII stream's ids are pinned (sha256 before the mode existed)."""
    import hashlib
    from array import array

    ids, text, _, _ = model._stream()
    assert hashlib.sha256(array("i", ids).tobytes()).hexdigest()[:16] == "96c51f223e04722d"
    plain = model.generate(model.plan_completion(chat_ids("Explain idea 7 step by step."), LENGTHS), 1 << 20)
    assert text.isascii() and plain.text.isascii() and len(plain.output_ids) == 372


@pytest.mark.parametrize("thinking", [True, False])
def test_non_ascii_text_is_the_same_words_with_em_dashes_for_some_commas(thinking):
    prompt = chat_ids("Explain idea 7 step by step.", thinking)
    plain = model.generate(model.plan_completion(prompt, LENGTHS), 1 << 20)
    dashed = model.generate(model.plan_completion(prompt, LENGTHS, non_ascii=True), 1 << 20)
    assert dashed.text.count(" \u2014 ") > 0 and dashed.text.replace("\u2014", "").isascii()
    assert set(dashed.text) - set(plain.text) == {"\u2014"}
    # part by part (thought, answer), the dashed text with its dashes written back as commas is the plain text,
    # up to where the shorter ends (the same number of tokens covers fewer words: a dash is 4 tokens, a comma 1)
    for p, d in zip(plain.text.split("</think>"), dashed.text.split("</think>")):
        d = d.replace(" \u2014", ",")
        n = min(len(p), len(d)) - 40  # the last word of the shorter part may be cut short by a dash's tokens
        assert n > 0 and p[:n] == d[:n]


@pytest.mark.parametrize("text", ["Explain idea 7 step by step.", "question", "alpha", "beta"])
def test_non_ascii_output_re_tokenises_to_its_own_ids(text):
    prompt = chat_ids(text)
    g = model.generate(model.plan_completion(prompt, LENGTHS, non_ascii=True), 1 << 20)
    assert tok.decode(tok.encode(g.text)) == g.text and "\ufffd" not in g.text
    assert tok.encode(g.text + tok.IM_END) == g.output_ids, "thought and answer end on whole characters"
    dash = g.output_ids.index(0xE2)
    assert g.output_ids[dash - 1 : dash + 3] == list(" \u2014".encode())  # byte-fallback tokens


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_non_ascii_continuation_from_inside_a_character_equals_generating_with_a_larger_cap(k):
    prompt = chat_ids("Explain idea 7 step by step.")
    full = model.generate(model.plan_completion(prompt, LENGTHS, non_ascii=True), 1 << 20)
    cap = full.output_ids.index(0xE2) - 1 + k  # k tokens of " —": the space, then 1, 2 or 3 of its bytes
    first = model.generate(model.plan_completion(prompt, LENGTHS, non_ascii=True), cap)
    rest = model.generate(model.plan_completion(prompt + first.output_ids, LENGTHS, non_ascii=True), 1 << 20)
    assert first.output_ids + rest.output_ids == full.output_ids
    assert first.text.endswith("\ufffd") == (k in (2, 3))  # decoded alone, a cut character is U+FFFD
