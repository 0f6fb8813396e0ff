"""The emulator's throughput model: running slots, the waiting queue and its
503, the KV budget, real-time decode and prefill, load reporting."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support import waiting

pytestmark = pytest.mark.timeout(60)

QUEUE_FULL = "The request queue is full."


def gen(http, n_tokens: int, **extra):
    return http.post(
        "/generate", {"text": "go", "sampling_params": {"max_new_tokens": n_tokens, "ignore_eos": True}, **extra}
    )


def wait_for(what: str, ready, timeout_s: float = 5.0):
    """Polled often and briefly: these conditions last a fraction of a second."""
    return waiting.wait_for(what, ready, timeout_s, every_s=0.02)


def load(http) -> dict:
    return http.get("/v1/loads")[1]["loads"][0]


def load_when(http, **expected) -> dict:
    """The first /v1/loads row showing `expected` (e.g. num_waiting_reqs=3)."""

    def matching():
        row = load(http)
        return row if all(row[k] == v for k, v in expected.items()) else None

    return wait_for("a load report that matches", matching)


def test_requests_beyond_max_running_requests_wait_in_the_queue(emulator):
    http = emulator("--max-running-requests", "2", "--decode-tokens-per-s", "200", "--max-total-tokens", "2000")
    with ThreadPoolExecutor(5) as pool:
        started = time.monotonic()
        futures = [pool.submit(gen, http, 50) for _ in range(5)]  # 0.25 s each, 3 waves
        busy = load_when(http, num_waiting_reqs=3)
        assert busy["num_running_reqs"] == 2 and busy["num_used_tokens"] > 0 and busy["token_usage"] > 0
        assert all(f.result()[0] == 200 for f in futures)
    assert time.monotonic() - started >= 0.7
    assert load(http)["num_running_reqs"] == 0


def test_a_full_waiting_queue_answers_503_in_sglangs_shapes(emulator):
    http = emulator("--max-running-requests", "1", "--max-queued-requests", "1", "--decode-tokens-per-s", "100")
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(gen, http, 60)
        wait_for("one request running", lambda: load(http)["num_running_reqs"] == 1)
        waiting = pool.submit(gen, http, 10)
        wait_for("one request waiting", lambda: load(http)["num_waiting_reqs"] == 1)
        full = {"object": "error", "message": QUEUE_FULL, "type": "503", "param": None, "code": 503}
        assert gen(http, 5) == (503, full)
        msgs = [{"role": "user", "content": "hi"}]
        assert http.post("/v1/chat/completions", {"messages": msgs, "max_tokens": 5}) == (503, full)
        status, events = http.sse("/v1/chat/completions", {"messages": msgs, "max_tokens": 5, "stream": True})
        assert status == 200 and events == [
            {
                "error": {
                    "object": "error",
                    "message": QUEUE_FULL,
                    "type": "SERVICE_UNAVAILABLE",
                    "param": None,
                    "code": 503,
                }
            },
            "[DONE]",
        ]
        status, events = http.sse("/generate", {"text": "x", "stream": True})
        assert status == 200 and events[-1] == "[DONE]"
        assert events[0]["meta_info"]["finish_reason"] == {
            "type": "abort",
            "message": QUEUE_FULL,
            "status_code": 503,
            "err_type": None,
        }
        assert running.result()[0] == 200 and waiting.result()[0] == 200


def test_the_kv_budget_limits_how_many_long_requests_run_at_once(emulator):
    http = emulator("--max-total-tokens", "1000", "--decode-tokens-per-s", "400")
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(gen, http, 400) for _ in range(4)]  # ~402 KV tokens each: two fit
        busy = load_when(http, num_waiting_reqs=2)
        assert busy["num_running_reqs"] == 2 and busy["max_running_requests"] > 2
        assert all(f.result()[0] == 200 for f in futures)


def test_decode_rate_sets_the_latency(emulator):
    http = emulator("--decode-tokens-per-s", "500")
    t = time.monotonic()
    body = gen(http, 200)[1]
    elapsed = time.monotonic() - t
    # 200 tokens at 500/s: never sooner than 0.4 s (a slow machine can only make it later), and the latency the
    # server reports is the time the client waited, not more
    assert 0.4 <= body["meta_info"]["e2e_latency"] <= elapsed


def test_prefill_rate_adds_prompt_time(emulator):
    http = emulator("--prefill-tokens-per-s", "2000")
    ids = [256] * 1000  # 1000 prompt tokens: 0.5 s of prefill
    body = http.post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}})[1]
    assert body["meta_info"]["e2e_latency"] >= 0.48


def test_zero_decode_rate_is_instant(emulator):
    paced = emulator("--decode-tokens-per-s", "2000")
    one_paced = gen(paced, 4000)[1]["meta_info"]["e2e_latency"]  # 4000 tokens at 2000/s: at least 2 s
    instant = emulator()
    twenty_instant = sum(gen(instant, 4000)[1]["meta_info"]["e2e_latency"] for _ in range(20))
    assert one_paced >= 2.0 and twenty_instant < one_paced / 2  # twenty replies cost less than one paced one


def test_gen_throughput_counts_decoding_requests(emulator):
    http = emulator("--decode-tokens-per-s", "300", "--enable-metrics")
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(gen, http, 150) for _ in range(2)]
        busy = load_when(http, num_running_reqs=2)
        assert busy["gen_throughput"] == pytest.approx(600.0)
        info = http.get("/server_info")[1]
        assert info["internal_states"][0]["last_gen_throughput"] == pytest.approx(600.0)
        assert "sglang:num_running_reqs{" in http.get("/metrics")[1]
        [f.result() for f in futures]


def test_each_dp_rank_reports_its_own_load(emulator):
    http = emulator("--dp-size", "2", "--max-running-requests", "4")
    loads = http.get("/v1/loads")[1]["loads"]
    assert [x["dp_rank"] for x in loads] == [0, 1] and all(x["max_running_requests"] == 4 for x in loads)
    assert len(http.get("/server_info")[1]["internal_states"]) == 2
    assert [x["dp_rank"] for x in http.get("/v1/loads?dp_rank=1")[1]["loads"]] == [1]


def test_a_client_that_goes_away_frees_its_slot(emulator):
    http = emulator("--decode-tokens-per-s", "50")
    with pytest.raises(OSError):  # times out long before the 4 s of decoding
        http.post(
            "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}, timeout=0.3
        )
    wait_for("the slot freed", lambda: load(http)["num_running_reqs"] == 0, 3)
