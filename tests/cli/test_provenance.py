"""A fleet whose servers disagree about what they serve, on the terminal: one line naming the server and what
differs, exit 2, nothing generated."""

from tests.cli.test_mistakes import one_line
from tests.support.cli import dflash
from tests.support.shards import FAST, make_shard


def test_dflash_generate_refuses_a_server_with_another_template_in_one_line_and_exits_2(tmp_path, emulator):
    same, other = emulator(*FAST), emulator(*FAST, "--template-variant", "qwen3.5-default-system")
    data = tmp_path / "data"
    make_shard(data, [same.emu.url])
    urls = f"{same.emu.url},{other.emu.url}"
    result = dflash("generate", "--shard", "00000", "--urls", urls, "--data-dir", str(data))
    line = one_line(result)
    assert result.returncode == 2, line
    assert line.startswith(f"dflash generate: server {other.emu.url} differs from {same.emu.url}: template_fingerprint")
    assert not (data / "completions").exists()
