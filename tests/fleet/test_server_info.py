"""What the client reads from a server is what 0.5.23 resolved: slots of every DP rank, the detected parser."""

import threading
import time

from dflash_assets.fleet.fleet import on_fleet
from dflash_assets.fleet.status import fleet_status
from dflash_assets.generation.engine import generate_shard
from dflash_assets.generation.preflight import check_fleet
from dflash_assets.settings import DispatchSettings, GenerationSettings
from tests.support.http import read_info
from tests.support.shards import FAST, cont, generate, make_shard, rows


def test_a_dp_size_4_server_reports_one_internal_state_per_rank_and_the_client_sums_them(emulator):
    server = emulator(*FAST, "--dp-size", "4", "--max-running-requests", "4")
    _, body = server.get("/server_info")
    assert [s["effective_max_running_requests_per_dp"] for s in body["internal_states"]] == [4, 4, 4, 4]
    assert read_info(server.emu.url).max_running_requests == 16
    [status] = fleet_status(attach_urls=[server.emu.url])
    assert status.max_running_requests == 16


def test_a_dp_size_4_server_is_driven_at_all_four_ranks_slots(tmp_path, emulator):
    server = emulator(*FAST, "--dp-size", "4", "--max-running-requests", "4", "--length-median", "30")
    data = tmp_path / "data"
    make_shard(data, [server.emu.url])  # 40 prompts
    server.post("/_emulator/faults", {"hold": True})
    settings = DispatchSettings(waiting_margin=2, load_sample_s=0)
    done = threading.Thread(
        target=lambda: on_fleet(
            [server.emu.url],
            lambda f: generate_shard(
                data, "00000", f, GenerationSettings(max_output_tokens=256), settings, log=lambda m: None
            ),
        )
    )
    done.start()
    try:
        for _ in range(400):  # the run fills the server's slots; wait (bounded) until it has
            if server.get("/_emulator/faults")[1]["requests_seen"] >= 18:
                break
            time.sleep(0.05)
        # 4 ranks x 4 slots + a waiting margin of 2: reading internal_states[0] only would stop at 4 + 2
        assert server.get("/_emulator/faults")[1]["requests_seen"] == 18
    finally:
        server.post("/_emulator/faults", {"hold": None})
        done.join(60)
    assert server.get("/_emulator/faults")[1]["requests_seen"] == 40


def test_reasoning_parser_auto_is_read_as_the_parser_model_info_detected(emulator):
    server = emulator("--decode-tokens-per-s", "0", "--reasoning-parser", "auto")
    assert server.get("/server_info")[1]["reasoning_parser"] == "auto"
    assert server.get("/model_info")[1]["reasoning_parser"] == "qwen3"
    info = read_info(server.emu.url)
    assert info.reasoning_parser == "qwen3"
    assert check_fleet([info], enable_thinking=True) == []


def test_a_fleet_with_reasoning_parser_auto_can_be_continued(tmp_path, emulator):
    server = emulator("--decode-tokens-per-s", "0", "--reasoning-parser", "auto")
    data = tmp_path / "data"
    make_shard(data, [server.emu.url])
    parent = generate(data, [server.emu.url], 64)
    run = cont(data, [server.emu.url], parent.config_hash, 4096)
    assert run.completed == 40 and run.failed == 0
    assert len(rows(data, run.config_hash)) == 40
