"""SpecForge's own rendering and loss mask for a conversations row (sgl-project/SpecForge
a6b6b0230009d15ec2a97a57384e6f53f0f96946), so the tests judge which assistant turns the trainer trains by its code:
- ChatTemplate, and the `qwen3.5` and `qwen3-instruct` templates: specforge/data/template.py;
- GeneralParser (its conversation path, and its ignore_token pass), ThinkingParser: specforge/data/parse.py;
- preprocess_conversations: specforge/data/preprocessing.py (its general- and thinking-parser branches);
- CharTokenizer: tests/test_scripts/test_expand_reasoning_conversations.py's `_CharTokenizer` (one token a
  character), used by that file's test_expanded_event_qwen35_masks_only_current_generation; its
  apply_chat_template renders as Qwen3's chat template does (the emulator's, dflash_assets/emulator/tokenizer.py:
  an assistant turn before the last user turn keeps its content only; tools, tool calls and tool results as Qwen3's
  template renders them), where the original always renders reasoning.
Torch is not a dependency here: tensors are lists (`torch.zeros(n)` is `[0] * n`, a slice assignment the same), and
the unused branches (tools' sanitising, the template-less fallback, pre-formatted text, ignore tokens) are left out.
"""
# ruff: noqa
# fmt: off

import re
import warnings
from typing import Any, Dict, List, Optional

from dflash_assets.emulator.tokenizer import apply_chat_template as qwen3_chat_template


# ---- specforge/data/template.py --------------------------------------------------------------------------------
class ChatTemplate:
    def __init__(self, assistant_header=None, user_header=None, system_prompt=None, end_of_turn_token=None,
                 parser_type="general", assistant_pattern_type="general", enable_thinking=False, ignore_token=None):
        self.assistant_header = assistant_header
        self.user_header = user_header
        self.system_prompt = system_prompt
        self.end_of_turn_token = end_of_turn_token
        self.parser_type = parser_type
        self.assistant_pattern_type = assistant_pattern_type
        self.enable_thinking = enable_thinking
        self.ignore_token = ignore_token


TEMPLATES = {
    "qwen3.5": ChatTemplate(
        assistant_header="<|im_start|>assistant\n<think>\n",
        user_header="<|im_start|>user\n",
        system_prompt="",
        end_of_turn_token="<|im_end|>\n",
        parser_type="thinking",
        enable_thinking=True,
    ),
    "qwen3-instruct": ChatTemplate(
        assistant_header="<|im_start|>assistant\n",
        user_header="<|im_start|>user\n",
        system_prompt="You are a helpful assistant.",
        end_of_turn_token="<|im_end|>\n",
        ignore_token=["<think>\n\n</think>\n\n"],
    ),
}


# ---- tests/test_scripts/test_expand_reasoning_conversations.py ---------------------------------------------------
class _CharEncoding:
    def __init__(self, text: str, max_length: int | None = None):
        ids = [ord(char) for char in text]
        if max_length is not None:
            ids = ids[:max_length]
        self.input_ids = [ids]


class CharTokenizer:
    pad_token_id = 0
    unk_token_id = 0

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False, add_special_tokens=False,
                            tools=None, **kwargs):
        del tokenize, add_special_tokens, kwargs
        return qwen3_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools)

    def __call__(self, text, max_length=None, truncation=True, return_tensors=None, add_special_tokens=False,
                 **kwargs):
        del truncation, return_tensors, add_special_tokens, kwargs
        return _CharEncoding(text, max_length=max_length)

    def encode(self, text, add_special_tokens=False, truncation=True, max_length=None):
        del add_special_tokens, truncation
        ids = [ord(char) for char in text]
        return ids[:max_length] if max_length is not None else ids

    def decode(self, ids, skip_special_tokens=False):
        del skip_special_tokens
        return "".join(chr(int(token_id)) for token_id in ids)


# ---- specforge/data/parse.py ------------------------------------------------------------------------------------
class GeneralParser:

    def __init__(self, tokenizer, chat_template: ChatTemplate):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.standard_keys = {"role", "content", "tool_calls"}
        self.system_prompt = chat_template.system_prompt
        self.user_message_separator = f"{chat_template.end_of_turn_token}"
        self.assistant_message_separator = f"{chat_template.assistant_header}"
        self.set_assistant_pattern(chat_template)

    def _sanitize_message(self, message: dict) -> dict:
        cleaned = {k: v for k, v in message.items() if k in self.standard_keys}
        return cleaned

    def _normalize_message(self, message: dict) -> dict:
        role = message.get("role", message.get("from", ""))
        content = message.get("content") or message.get("value") or ""

        if role in ("human", "user"):
            role = "user"
        elif role in ("gpt", "assistant"):
            role = "assistant"

        normalized = {**message, "role": role, "content": content}
        normalized.pop("from", None)
        normalized.pop("value", None)
        return normalized

    def apply_chat_template(self, messages, tool, **kwargs) -> str:
        conversation = self.tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=False,
            tools=tool if tool else None,
            **kwargs,
        )
        return conversation

    def set_assistant_pattern(self, chat_template: ChatTemplate):
        self.assistant_pattern = (
            re.escape(self.assistant_message_separator)
            + r"([\s\S]*?(?:"
            + re.escape(self.chat_template.end_of_turn_token)
            + "|$))"
        )

    def parse(self, conversation, max_length: int, preformatted: bool = False, train_only_last_turn: bool = False,
              tool: List[Dict] = [], **kwargs):
        conversation = [
            self._normalize_message(message) for message in conversation
        ]
        messages = []

        if conversation[0]["role"] == "system":
            messages.append(
                {"role": "system", "content": conversation[0]["content"]}
            )
            conversation = conversation[1:]
        else:
            if self.system_prompt:
                messages.append({"role": "system", "content": self.system_prompt})

        while conversation and conversation[0]["role"] != "user":
            warnings.warn(
                f"Dropping leading '{conversation[0]['role']}' message before the first user turn."
            )
            conversation = conversation[1:]

        for j, sentence in enumerate(conversation):
            role = sentence["role"]
            if j == 0:
                if role != "user":
                    warnings.warn(
                        f"Conversation must start with a 'user' role, but found '{role}'. Conversation truncated."
                    )
                    break
            else:
                prev_role = conversation[j - 1]["role"]
                if role == "tool" and prev_role not in ["assistant", "tool"]:
                    break
                if role == "assistant" and prev_role not in ["user", "tool"]:
                    break
            sentence = self._sanitize_message(sentence)
            messages.append(sentence)
        conversation = self.apply_chat_template(messages, tool=tool, **kwargs)

        # get input_ids
        encoding = self.tokenizer(
            conversation,
            max_length=max_length,
            truncation=True,
            return_tensors="pt",
            add_special_tokens=False,
        )
        input_ids = encoding.input_ids[0]
        loss_mask = [0] * len(input_ids)

        matches = list(re.finditer(self.assistant_pattern, conversation, re.DOTALL))
        if train_only_last_turn and matches:
            matches = [matches[-1]]  # Only keep the last match

        for match in matches:
            content_start_char = match.start(1)
            content_end_char = match.end(1)

            prefix_ids = self.tokenizer.encode(
                conversation[:content_start_char],
                add_special_tokens=False,
                truncation=True,
                max_length=max_length,
            )
            full_ids = self.tokenizer.encode(
                conversation[:content_end_char],
                add_special_tokens=False,
                truncation=True,
                max_length=max_length,
            )

            start_token_idx = len(prefix_ids)
            end_token_idx = len(full_ids)

            # Handling out-of-bounds errors caused by truncation
            actual_start = min(start_token_idx, len(input_ids))
            actual_end = min(end_token_idx, len(input_ids))

            if actual_start < actual_end:
                loss_mask[actual_start:actual_end] = [1] * (actual_end - actual_start)

        # Zero out loss_mask for ignore_tokens
        ignore_tokens = self.chat_template.ignore_token
        if ignore_tokens:
            for token_str in ignore_tokens:
                start = 0
                while True:
                    idx = conversation.find(token_str, start)
                    if idx == -1:
                        break
                    ignore_start_char = idx
                    ignore_end_char = idx + len(token_str)

                    prefix_ids = self.tokenizer.encode(
                        conversation[:ignore_start_char],
                        add_special_tokens=False,
                        truncation=True,
                        max_length=max_length,
                    )
                    full_ids = self.tokenizer.encode(
                        conversation[:ignore_end_char],
                        add_special_tokens=False,
                        truncation=True,
                        max_length=max_length,
                    )

                    start_token_idx = min(len(prefix_ids), len(input_ids))
                    end_token_idx = min(len(full_ids), len(input_ids))

                    if start_token_idx < end_token_idx:
                        loss_mask[start_token_idx:end_token_idx] = [0] * (end_token_idx - start_token_idx)

                    start = ignore_end_char

        return input_ids, loss_mask


class ThinkingParser(GeneralParser):

    def __init__(self, tokenizer, chat_template: ChatTemplate):
        super().__init__(tokenizer, chat_template)
        self.standard_keys = {
            "role",
            "content",
            "tool_calls",
            "reasoning_content",
            "name",
            "tool_call_id",
        }

    def apply_chat_template(self, messages, tool, **kwargs) -> str:
        conversation = self.tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=False,
            add_special_tokens=False,
            tools=tool if tool else None,
            **kwargs,
        )
        return conversation

    def parse(self, conversation, max_length: int, preformatted: bool = False, train_only_last_turn: bool = False,
              tool: List[Dict] = [], **kwargs):
        if self.chat_template.enable_thinking:
            kwargs["enable_thinking"] = True
        return super().parse(
            conversation, max_length, preformatted, train_only_last_turn, tool, **kwargs
        )


# ---- specforge/data/preprocessing.py ----------------------------------------------------------------------------
def preprocess_conversations(tokenizer, conversations, chat_template: ChatTemplate, max_length: int = 2048,
                             is_preformatted: bool = False, train_only_last_turn: bool = False,
                             tools: Optional[List[List[Dict]]] = [[]], **kwargs) -> Dict[str, List[Any]]:
    results: Dict[str, List[Any]] = {"input_ids": [], "loss_mask": [], "attention_mask": []}
    if chat_template.parser_type == "general":
        parser = GeneralParser(tokenizer, chat_template)
    elif chat_template.parser_type == "thinking":
        parser = ThinkingParser(tokenizer, chat_template)
    else:
        raise ValueError(f"Invalid parser type: {chat_template.parser_type}")
    kwargs_list: List[Dict[str, Any]] = [{} for _ in range(len(conversations))]
    for key, value_list in kwargs.items():
        for i, value in enumerate(value_list):
            kwargs_list[i][key] = value
    for source, tool, kwargs_item in zip(conversations, tools, kwargs_list):
        if not source:
            # if the source is None, skip it
            continue
        input_ids, loss_mask = parser.parse(
            source,
            max_length,
            preformatted=is_preformatted,
            train_only_last_turn=train_only_last_turn,
            tool=tool,
            **kwargs_item,
        )
        results["input_ids"].append([input_ids])
        results["loss_mask"].append([loss_mask])
        results["attention_mask"].append([[1] * len(loss_mask)])
    return results
