"""The emulator samples as a server does when asked (`--sampling per-request`): a new draw per request at a
temperature above 0, the same completion at temperature 0 or with a sampling seed, and with `--random-seed` the
same n-th draw of a prompt on every server run."""


def test_temperature_zero_or_a_seed_gives_the_same_completion_every_time(emulator):
    server = emulator("--reasoning-parser", "qwen3", "--sampling", "per-request")
    prompt = {
        "text": "<|im_start|>user\nHow long?<|im_end|>\n<|im_start|>assistant\n",
        "sampling_params": {"max_new_tokens": 32000},
    }

    def lengths_of(sampling):
        body = {**prompt, "sampling_params": {**prompt["sampling_params"], **sampling}}
        return [server.post("/generate", body)[1]["meta_info"]["completion_tokens"] for _ in range(6)]

    assert len(set(lengths_of({"temperature": 0.0}))) == 1
    assert len(set(lengths_of({"temperature": 0.6, "sampling_seed": 7}))) == 1
    assert len(set(lengths_of({"temperature": 0.6}))) > 1


def test_with_a_random_seed_each_request_draws_anew_and_every_run_draws_the_same(emulator):
    """`--random-seed`: the n-th request of a prompt draws the same on every server run, whatever order the
    prompts arrive in, so a test comparing distributions fails by its seed, never by chance."""
    prompts = [
        {
            "text": f"<|im_start|>user\nHow long is answer {k}?<|im_end|>\n<|im_start|>assistant\n",
            "sampling_params": {"max_new_tokens": 32000, "temperature": 0.6},
        }
        for k in range(2)
    ]

    def run(order, seed):
        server = emulator("--reasoning-parser", "qwen3", "--sampling", "per-request", "--random-seed", seed)
        seen: dict[int, list[int]] = {0: [], 1: []}
        for k in order:
            seen[k].append(server.post("/generate", prompts[k])[1]["meta_info"]["completion_tokens"])
        return seen

    first, reordered = run([0, 1, 0, 1, 0, 1], "7"), run([1, 1, 1, 0, 0, 0], "7")
    assert first == reordered
    assert len(set(first[0])) == 3 and len(set(first[1])) == 3  # each request of a prompt is a new draw
    assert run([0, 1, 0, 1, 0, 1], "8") != first
