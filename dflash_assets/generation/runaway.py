"""Runaway generations: a row cut at its cap while repeating itself is not a long answer, it is a loop, and a larger
cap only makes it longer. `is_runaway` tells it from an honest long answer by the end of its output (repeated word
n-grams, or one line making up most of the lines): generation stops a stream by it (send.watch_of), quality counts
the cut rows by it (quality/tables.py).
"""

from collections import Counter

from dflash_assets.settings import RunawaySettings


def is_runaway(text: str | None, runaway: RunawaySettings = RunawaySettings()) -> bool:
    """True when the end of `text` repeats itself by either rule. The tail's first line and word may be cut
    mid-way by the window, so they are left out of the counts."""
    # (a loop of a phrase with no newline, or of a paragraph, is caught by the n-grams; of a short line, by both)
    if not text:
        return False
    tail = text[-runaway.tail_chars :].rstrip()
    # A loop reaches the cap, so the end of the text recurs earlier in its tail: the last line (or its last
    # characters) found once more. Checked first, at C speed: prose stops here, and this runs on every cut row.
    end = tail[tail.rfind("\n") + 1 :].strip()[-runaway.end_chars :]
    if not end or tail.find(end) >= len(tail) - len(end):
        return False
    lines = [line.strip() for line in tail.splitlines() if line.strip()][1:]
    if len(lines) >= runaway.min_line_repeats:
        top = Counter(lines).most_common(1)[0][1]
        if top >= runaway.min_line_repeats and top / len(lines) >= runaway.repeated_line_share:
            return True
    words, n = tail.split()[1:], runaway.ngram_words
    grams = len(words) - n + 1
    if grams < runaway.min_ngrams:
        return False
    distinct = len(set(zip(*(words[i:] for i in range(n)))))
    return 1 - distinct / grams >= runaway.repeated_ngram_share


def loop_start(text: str, runaway: RunawaySettings = RunawaySettings()) -> int:
    """Where the repetition that ends `text` began, as a character offset (len(text) when none is found): the
    start of the longest end of the text that repeats with the period of its last line (the `end` is_runaway
    looks for). Exact repetition only: a loop that drifts a little is found later than it began."""
    tail = text.rstrip()
    end = tail[tail.rfind("\n") + 1 :].strip()[-runaway.end_chars :]
    last = tail.rfind(end) if end else -1
    prev = tail.rfind(end, 0, last) if last > 0 else -1
    if prev < 0:
        return len(text)
    period, start = last - prev, len(tail) - (last - prev)
    while start >= period and tail[start - period : start] == tail[start : start + period]:  # a period at a time
        start -= period
    while start > 0 and tail[start - 1] == tail[start - 1 + period]:  # then to the character
        start -= 1
    return start
