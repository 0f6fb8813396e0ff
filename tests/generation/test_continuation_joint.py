"""A cap that cuts a multi-byte character in two: the continued row holds it whole.

SGLang 0.5.23 answers the cut row with text ending in U+FFFD, and the continuation's `/generate` text without
the character at all (it decodes the new ids after the prompt's last ids and keeps what their text does not
cover: tests/emulator/test_detokenizer.py runs the wheel's own code on it). Joining the two texts would store
U+FFFD where the character was; the continued row's text is the whole id sequence decoded in one piece instead.
The emulator's --non-ascii mode writes em dashes as byte tokens, so the cut is forced, not hoped for.
"""

import duckdb
import pytest

from dflash_assets.emulator import tokenizer as tok
from tests.support import shards
from tests.support.forks import start_emulator

FLAGS = ["--decode-tokens-per-s", "0", "--reasoning-parser", "qwen3", "--non-ascii"]
SETTINGS = shards.SETTINGS.model_copy(update={"commit_rows": 1})
PROMPT = {"joint": "Explain idea 7 step by step."}
WIDE_CAP = 8192  # past the end of this prompt's completion: nothing is cut there
DASH = "\u2014"
LEAD = DASH.encode()[0]  # the em dash's first UTF-8 byte, as a byte token id
COLUMNS = "finish_reason, completion_tokens, reasoning_tokens, content, reasoning_content, output_ids"


@pytest.fixture(scope="module")
def url():
    with start_emulator(FLAGS) as emu:
        yield emu.url


def row(data_dir, config_hash) -> dict:
    rel = duckdb.sql(
        f"select {COLUMNS} from read_parquet('{data_dir}/completions/**/*.parquet', union_by_name = "
        f"true) where config_hash = '{config_hash}'"
    )
    (values,) = rel.fetchall()
    return dict(zip(rel.columns, values))


@pytest.fixture(scope="module")
def uncut(tmp_path_factory, url):
    """The prompt generated from scratch at a cap that cuts nothing: where its dashes are, and the row to match."""
    data = tmp_path_factory.mktemp("uncut") / "data"
    shards.make_shard(data, [url], PROMPT)
    run = shards.generate(data, [url], WIDE_CAP, SETTINGS)
    full = row(data, run.config_hash)
    assert full["finish_reason"] == "stop" and DASH in full["content"] and DASH in full["reasoning_content"]
    return full


@pytest.mark.parametrize("where", ["thought", "answer"])
@pytest.mark.parametrize("into", [1, 2])
def test_a_character_cut_at_the_cap_is_whole_in_the_continued_row(tmp_path, url, uncut, where, into):
    ids = uncut["output_ids"]
    think_end = ids.index(tok.THINK_END_ID)
    lead = ids.index(LEAD) if where == "thought" else ids.index(LEAD, think_end)
    assert (lead < think_end) == (where == "thought")
    cap = lead + into  # the parent keeps `into` of the dash's 3 bytes
    data = tmp_path / "data"
    shards.make_shard(data, [url], PROMPT)
    parent = shards.generate(data, [url], cap, SETTINGS)
    cut = row(data, parent.config_hash)
    part = "reasoning_content" if where == "thought" else "content"
    assert (cut["finish_reason"], cut["completion_tokens"]) == ("length", cap)
    assert cut[part].endswith(" \ufffd") and cut[part].count("\ufffd") == 1, "what SGLang returns for the cut row"

    run = shards.cont(data, [url], parent.config_hash, WIDE_CAP, SETTINGS)
    assert (run.continued, run.completed) == (1, 1)
    continued = row(data, run.config_hash)
    joint = cut[part][: -len("\ufffd")] + DASH
    assert continued[part].startswith(joint), "the character cut at the cap is whole at the joint"
    assert not any("\ufffd" in (continued[c] or "") for c in ("content", "reasoning_content"))
    assert continued == uncut, "the continued row is the row a generation at the larger cap makes"
