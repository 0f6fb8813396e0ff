"""The `/generate` JSON contract gate of SGLang 0.5.23, re-implemented: 0.5.23 decodes every body with
`GenerateRequest.from_json_value` (sglang/api/v1/api_types.py) and answers a violation with 400 `{"error": "<the
decoder's text>"}`. Same shapes, same serde-style messages (tests/emulator/test_sglang_contract.py runs both).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Decoder = Callable[[Any], None]


class ContractError(ValueError):
    """The body violates the contract: SGLang's 400 with this text."""


def _unexpected(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"boolean `{'true' if v else 'false'}`"
    if isinstance(v, int):
        return f"integer `{v}`"
    if isinstance(v, float):
        return f"floating point `{v}`"
    if isinstance(v, str):
        return f'string "{v}"'
    if isinstance(v, list):
        return "sequence"
    if isinstance(v, dict):
        return "map"
    return type(v).__name__


def _invalid(v: Any, expected: str) -> ContractError:
    return ContractError(f"invalid type: {_unexpected(v)}, expected {expected}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# ---- scalar and combinator decoders (each raises ContractError or returns None) ----


def _typed(ok: Callable[[Any], bool], default: str) -> Callable[..., Decoder]:
    """A scalar decoder's maker: `v` must pass `ok`, else the serde message names `expected`."""

    def make(expected: str = default) -> Decoder:
        def d(v):
            if not ok(v):
                raise _invalid(v, expected)

        return d

    return make


boolean = _typed(lambda v: isinstance(v, bool), "a boolean")
integer = _typed(_is_int, "i64")
number = _typed(lambda v: _is_int(v) or isinstance(v, float), "f64")
string = _typed(lambda v: isinstance(v, str), "a string")


def unsigned(expected: str) -> Decoder:
    def d(v):
        integer(expected)(v)
        if v < 0:
            raise ContractError(f"invalid value: integer `{v}`, expected {expected}")

    return d


def anything(v: Any) -> None:
    return None


def nullable(inner: Decoder) -> Decoder:
    """`None if x is None else decode(x)`: the generated code's Optional arm."""

    def d(v):
        if v is not None:
            inner(v)

    return d


def seq(elem: Decoder, expected: str = "a sequence") -> Decoder:
    def d(v):
        if not isinstance(v, list):
            raise _invalid(v, expected)
        for e in v:
            elem(e)

    return d


def mapping(value: Decoder, expected: str = "a map") -> Decoder:
    def d(v):
        if not isinstance(v, dict):
            raise _invalid(v, expected)
        for e in v.values():
            value(e)

    return d


def scalar_or_list(name: str, scalar: Callable[[str], Decoder], list_dec: Decoder) -> Decoder:
    """`XOrList`: a list goes to the list decoder, anything else must be the scalar."""
    one = scalar(f"a value or an array of values for {name}")

    def d(v):
        if isinstance(v, list):
            list_dec(v)
        else:
            one(v)

    return d


def flat_or_batch(name: str, first_is_flat: Callable[[Any], bool], flat: Decoder, batch: Decoder) -> Decoder:
    """`TokenIdsOrList` / `StringListOrList`: [] and [scalar, ...] are one list, else a batch."""

    def d(v):
        if not isinstance(v, list):
            raise _invalid(v, f"a value or an array of values for {name}")
        (flat if not v or first_is_flat(v[0]) else batch)(v)

    return d


def struct(name: str, fields: dict[str, Decoder], deny_unknown: bool) -> Decoder:
    names = tuple(fields)

    def d(v):
        if not isinstance(v, dict):
            raise _invalid(v, f"struct {name}")
        for key, x in v.items():
            dec = fields.get(key)
            if dec is not None:
                dec(x)
            elif deny_unknown:
                raise _unknown_field(key, names)

    return d


def _unknown_field(key: str, fields: tuple[str, ...]) -> ContractError:
    if not fields:
        return ContractError(f"unknown field `{key}`, there are no fields")
    if len(fields) == 1:
        return ContractError(f"unknown field `{key}`, expected `{fields[0]}`")
    if len(fields) == 2:
        return ContractError(f"unknown field `{key}`, expected `{fields[0]}` or `{fields[1]}`")
    listed = ", ".join(f"`{f}`" for f in fields)
    return ContractError(f"unknown field `{key}`, expected one of {listed}")


# ---- the 0.5.23 shapes ------------------------------------------------------------


TOKEN_IDS = seq(integer())
STRING_LIST = seq(string())
STRING_OR_LIST = scalar_or_list("StringOrList", string, STRING_LIST)
BOOL_OR_LIST = scalar_or_list("BoolOrList", boolean, seq(boolean()))
INT64_OR_LIST = scalar_or_list("Int64OrList", integer, seq(integer()))
TOKEN_IDS_OR_LIST = flat_or_batch(
    "TokenIdsOrList", lambda e: _is_int(e) or isinstance(e, float), TOKEN_IDS, seq(TOKEN_IDS)
)
OPTIONAL_STRING_LIST = seq(nullable(string()))
OPTIONAL_STRING_OR_LIST = scalar_or_list("OptionalStringOrList", string, OPTIONAL_STRING_LIST)
OPTIONAL_INT64_OR_LIST = scalar_or_list("OptionalInt64OrList", integer, seq(nullable(integer())))
STRING_LIST_OR_LIST = flat_or_batch("StringListOrList", lambda e: isinstance(e, str), STRING_LIST, seq(STRING_LIST))

WATERMARK = struct(
    "WatermarkRequestConfig",
    {"enabled": nullable(boolean()), "key": nullable(string()), "context_window": nullable(integer())},
    deny_unknown=True,
)

# Every key of SamplingParams, in the schema's order (the order the unknown-field message lists).
SAMPLING_PARAMS_FIELDS: dict[str, Decoder] = {
    "max_new_tokens": nullable(integer()),
    "stop": nullable(STRING_OR_LIST),
    "stop_token_ids": nullable(seq(integer())),
    "stop_regex": nullable(STRING_OR_LIST),
    "temperature": nullable(number()),
    "top_p": nullable(number()),
    "top_k": nullable(integer()),
    "min_p": nullable(number()),
    "frequency_penalty": nullable(number()),
    "presence_penalty": nullable(number()),
    "repetition_penalty": nullable(number()),
    "min_new_tokens": nullable(integer()),
    "n": nullable(integer()),
    "json_schema": nullable(string()),
    "regex": nullable(string()),
    "ebnf": nullable(string()),
    "structural_tag": nullable(string()),
    "ignore_eos": nullable(boolean()),
    "skip_special_tokens": nullable(boolean()),
    "spaces_between_special_tokens": nullable(boolean()),
    "no_stop_trim": nullable(boolean()),
    "stream_interval": nullable(integer()),
    "logit_bias": nullable(mapping(number())),
    "sampling_seed": nullable(integer()),
    "custom_params": anything,
    "beam_width": nullable(integer()),
    "watermark": nullable(WATERMARK),
    "choice": nullable(seq(string())),
}
SAMPLING_PARAMS = struct("SamplingParams", SAMPLING_PARAMS_FIELDS, deny_unknown=True)


def _struct_or_list(name: str, one: Decoder, each: Decoder) -> Decoder:
    """`SamplingParamsOrList` / `KvHintsEnvelopeOrList`: a list of `each`, or one map."""

    def d(v):
        if isinstance(v, list):
            seq(each)(v)
        elif not isinstance(v, dict):
            raise _invalid(v, f"a value or an array of values for {name}")
        else:
            one(v)

    return d


_MEDIA_REF = struct(
    "MediaRef",
    {
        "url": string(),
        "detail": nullable(string()),
        "max_dynamic_patch": nullable(integer()),
        "content_hash": nullable(string()),
        "min_pixels": nullable(integer()),
        "max_pixels": nullable(integer()),
        "total_max_pixels": nullable(integer()),
        "fps": nullable(number()),
        "num_frames": nullable(integer()),
        "min_frames": nullable(integer()),
        "max_frames": nullable(integer()),
        "max_tokens_per_frame": nullable(integer()),
        "max_image_tokens": nullable(integer()),
        "use_audio": nullable(boolean()),
        "image_grid_thw": nullable(seq(seq(integer()))),
    },
    deny_unknown=True,
)


def _media_item(v: Any) -> None:
    if isinstance(v, str):
        return
    if isinstance(v, dict):
        _MEDIA_REF(v)
        return
    raise _invalid(v, "one of the MediaItem shapes")


_MEDIA_ITEMS = seq(nullable(_media_item))


def _media_input(v: Any) -> None:
    if isinstance(v, (str, dict)):
        _media_item(v)
    elif isinstance(v, list):
        (seq(nullable(_MEDIA_ITEMS)) if v and isinstance(v[0], list) else _MEDIA_ITEMS)(v)
    else:
        raise _invalid(v, "one of the MediaInput shapes")


_KV_HINT_ACTION = struct(
    "KvHintAction",
    {"action_id": string(), "action_type": string(), "action_version": string(), "payload": anything},
    deny_unknown=False,
)
_KV_HINTS = struct(
    "KvHintsEnvelope",
    {"protocol_version": string(), "message_id": string(), "actions": nullable(seq(_KV_HINT_ACTION))},
    deny_unknown=False,
)


# unknown top-level keys ignored (the schema's rule); `return_prompt_token_ids`, `routed_experts_start_len` not nullable
GENERATE_REQUEST = struct(
    "GenerateRequest",
    {
        "rid": nullable(STRING_OR_LIST),
        "text": nullable(STRING_OR_LIST),
        "input_ids": nullable(TOKEN_IDS_OR_LIST),
        "stream": nullable(boolean()),
        "sampling_params": nullable(_struct_or_list("SamplingParamsOrList", SAMPLING_PARAMS, SAMPLING_PARAMS)),
        "return_logprob": nullable(BOOL_OR_LIST),
        "logprob_start_len": nullable(INT64_OR_LIST),
        "top_logprobs_num": nullable(INT64_OR_LIST),
        "token_ids_logprob": nullable(TOKEN_IDS_OR_LIST),
        "return_hidden_states": nullable(BOOL_OR_LIST),
        "return_text_in_logprobs": nullable(boolean()),
        "bootstrap_host": nullable(OPTIONAL_STRING_OR_LIST),
        "bootstrap_port": nullable(OPTIONAL_INT64_OR_LIST),
        "bootstrap_room": nullable(OPTIONAL_INT64_OR_LIST),
        "bootstrap_pair_key": nullable(OPTIONAL_STRING_OR_LIST),
        "decode_tp_size": nullable(OPTIONAL_INT64_OR_LIST),
        "routed_dp_rank": nullable(integer()),
        "disagg_prefill_dp_rank": nullable(integer()),
        "image_data": nullable(_media_input),
        "mm_hashes": nullable(STRING_LIST_OR_LIST),
        "video_data": nullable(_media_input),
        "audio_data": nullable(_media_input),
        "extra_key": nullable(STRING_OR_LIST),
        "priority": nullable(integer()),
        "cache_salt": nullable(STRING_OR_LIST),
        "require_reasoning": nullable(boolean()),
        "lora_path": nullable(OPTIONAL_STRING_OR_LIST),
        "session_params": anything,
        "kv_hints": nullable(_struct_or_list("KvHintsEnvelopeOrList", _KV_HINTS, nullable(_KV_HINTS))),
        "routing_key": nullable(string()),
        "max_thinking_tokens": nullable(unsigned("u64")),
        "session_id": nullable(string()),
        "custom_logit_processor": nullable(OPTIONAL_STRING_OR_LIST),
        "custom_labels": nullable(mapping(string())),
        "images_config": nullable(
            struct("ImagesConfig", {"image_mode": nullable(string()), "prefix": string()}, deny_unknown=False)
        ),
        "return_prompt_token_ids": boolean(),
        "routed_experts_start_len": integer(),
        "return_sampling_mask": nullable(BOOL_OR_LIST),
        "modalities": nullable(OPTIONAL_STRING_LIST),
    },
    deny_unknown=False,
)


def generate_contract_error(body: Any) -> str | None:
    """The contract violation in a parsed `/generate` JSON body, or None."""
    try:
        GENERATE_REQUEST(body)
    except ContractError as e:
        return str(e)
    return None
