"""The reasoning split of SGLang 0.5.23's Qwen3 parser, and its inverse, for text the pipeline joins itself.

/generate never separates reasoning, so a continued row is split here as the chat route splits a fresh completion
(parser/reasoning_parser.py, BaseReasoningFormatDetector.detect_and_parse). The parser strips no whitespace, so the
split loses only the `</think>` itself: whether the output held one is read from the token ids, which makes the
parent's raw text exactly recoverable.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK, THINK_END, TOOL_CALL = "<think>", "</think>", "<tool_call>"
PARSERS = (None, "qwen3", "qwen3-thinking")  # the <think> ... </think> parsers this module mirrors


def end_of(ids: list[int], pattern: tuple[int, ...]) -> int:
    """Index just past the first occurrence of `pattern` in `ids`, or -1."""
    n, i = len(pattern), -1
    while n:
        try:
            i = ids.index(pattern[0], i + 1)  # a C-speed scan for the first id; </think> is one id in Qwen3
        except ValueError:
            return -1
        if tuple(ids[i : i + n]) == pattern:
            return i + n
    return -1


@dataclass(frozen=True)
class Reasoning:
    """How one server splits a completion: with a parser at all, and whether it reasons from the first token."""

    separate: bool  # the server runs a reasoning parser (requests always ask separate_reasoning)
    force: bool  # the template pre-opens <think>: the output is reasoning until </think> (qwen3 + enable_thinking)
    end_ids: tuple[int, ...]  # </think> as token ids

    @classmethod
    def of(
        cls, parser: str | None, enable_thinking: bool, end_ids: list[int], always_thinks: bool = False
    ) -> Reasoning:
        """`always_thinks`: the template opens <think> whatever enable_thinking says (ServerInfo.always_thinks)."""
        if parser not in PARSERS:
            raise ValueError(
                f"continuing rows split by reasoning parser {parser!r} is not supported "
                f"(only {', '.join(str(p) for p in PARSERS)})"
            )
        force = parser == "qwen3-thinking" or (parser == "qwen3" and (enable_thinking or always_thinks))
        return cls(parser is not None, force, tuple(end_ids))

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning_content, content) as the chat route returns them: "" reasoning is null, content never."""
        if not self.separate or not (self.force or THINK in text):
            return None, text
        while text.startswith(THINK):
            text = text[len(THINK) :]
        if THINK_END in text:
            reasoning, _, content = text.partition(THINK_END)
        elif (cut := text.find(TOOL_CALL)) != -1:
            reasoning, content = text[:cut], text[cut:]
        else:
            reasoning, content = text, ""
        return reasoning or None, content

    def raw_text(self, reasoning: str | None, content: str, output_ids: list[int]) -> str:
        """A row's output (its reasoning_content, content and output_ids) as the server decoded it, before the split
        (enough of it to split again)."""
        if not self.separate or (reasoning is None and not self.force):
            return content  # the parser left the text alone
        closed = end_of(output_ids, self.end_ids) >= 0
        # unforced, the parser split only because the text opened <think>: keep it so the next split does too
        return ("" if self.force else THINK) + (reasoning or "") + (THINK_END if closed else "") + content

    def tokens(self, output_ids: list[int]) -> int:
        """Reasoning tokens as SGLang's scheduler counts them: through the first </think>, else all of them."""
        if not self.force:
            return 0
        end = end_of(output_ids, self.end_ids)
        return end if end >= 0 else len(output_ids)
