"""Rule-based rewards: pull the final answer out of a completion, check it against the gold answer.

Answer styles (`extract_answer`):

    gsm8k   the first line of text after the last `####`         ("... #### 1,234" -> "1,234")
    boxed   the contents of the last `\\boxed{...}` (or `\\fbox{...}`, or `\\boxed 5`), nested braces kept
    number  the leading number of the completion (the arithmetic task: the model emits "82" then EOS)
    final   the integer after the last `=` that ends the completion (the multiplication-trace task's worked
            answer "1*7=7,2*7=14" -> "14"; a trace cut off before its last product, "...,2*7", has none)

Equivalence (`verify`) goes through math-verify: both strings are wrapped in `$...$` (so bare LaTeX such as
`\\frac{1}{2}` or `\\text{(A)}` is read as math), parsed and compared symbolically and numerically (so
`0.5` == `\\frac{1}{2}` == `1/2`, `1,234` == `1234`, `\\dfrac{3}{4}` == `0.75`). Identical strings and equal
plain integers are decided without sympy.

Threads and timeouts (math-verify 0.9, read in `math_verify/utils.py`, `parser.py`, `grader.py`): its
`parse(parsing_timeout=5)` and `verify(timeout_seconds=5)` defaults install a `signal.alarm`, which raises
`ValueError("signal only works in main thread ...")` in any other thread. Passing `parsing_timeout=None`
and `timeout_seconds=None` disables that mechanism and works in every thread, but then nothing bounds the
time sympy spends: a completion answering `10^{10^{10}}` did not finish in 120 s on the CPU box (with the
alarm it is cut at 5 s and scored wrong). So `verify` keeps math-verify's alarm where it works (the main
thread of the main interpreter, `timeout_s` seconds per parse and per comparison) and passes `None` in
every other thread, where such an answer can stall the calling thread. Call `compute_rewards` from the main
thread to stay bounded.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence

ANSWER_STYLES = ("gsm8k", "boxed", "number", "final")

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_LEADING_NUMBER = re.compile(r"\s*([+-]?\d+(?:\.\d+)?)")
_INTEGER = re.compile(r"[+-]?\d+")
_FINAL_INTEGER = re.compile(r"=\s*([+-]?\d+)\s*$")


def last_boxed(text: str) -> str | None:
    """Contents of the last `\\boxed{...}` / `\\fbox{...}` in `text` (balanced braces), or of `\\boxed X`.

    `\\boxed{\\frac{1}{2}}` -> `\\frac{1}{2}`; `\\boxed 5$` -> `5` (the brace-less form ends at `$` or
    whitespace). None if there is no box or its braces never close.
    """
    start, command = -1, ""
    for c in _BOX_COMMANDS:
        i = text.rfind(c)
        if i > start:
            start, command = i, c
    if start < 0:
        return None
    i = start + len(command)
    if text.startswith(" ", i):  # "\boxed 5": one token up to '$' or whitespace
        rest = text[i + 1 :].lstrip()
        token = re.match(r"[^\s$]+", rest)
        return token.group(0) if token else None
    if not text.startswith("{", i):
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def extract_answer(text: str, style: str) -> str | None:
    """The final answer in a completion in answer style `style` (module docstring), or None if absent/empty."""
    if style == "gsm8k":
        i = text.rfind("####")
        answer = text[i + 4 :].strip().split("\n", 1)[0].strip() if i >= 0 else ""
    elif style == "boxed":
        answer = (last_boxed(text) or "").strip()
    elif style == "number":
        m = _LEADING_NUMBER.match(text)
        answer = m.group(1) if m else ""
    elif style == "final":
        m = _FINAL_INTEGER.search(text)
        answer = m.group(1) if m else ""
    else:
        raise ValueError(f"unknown answer style {style!r}: use one of {ANSWER_STYLES}")
    return answer or None


def _timeout_for_this_thread(timeout_s: int | None) -> int | None:
    """math-verify's signal alarm only works in the main thread; elsewhere it must be off (module docstring)."""
    return timeout_s if threading.current_thread() is threading.main_thread() else None


def _parse(answer: str, timeout_s: int | None):
    from math_verify import parse

    return parse(f"${answer}$", parsing_timeout=_timeout_for_this_thread(timeout_s))


def _verify_parsed(gold_parsed, pred_parsed, timeout_s: int | None) -> bool:
    from math_verify import verify as mv_verify

    return bool(mv_verify(gold_parsed, pred_parsed, timeout_seconds=_timeout_for_this_thread(timeout_s)))


def _trivially_decided(pred: str, gold: str) -> bool | None:
    """True/False when no sympy is needed (same string, or two plain integers), else None."""
    if pred == gold:
        return True
    if _INTEGER.fullmatch(pred) and _INTEGER.fullmatch(gold):
        return int(pred) == int(gold)
    return None


def _equal(pred: str, gold: str, timeout_s: int | None, parsed_golds: dict) -> bool:
    """`verify` with a cache of parsed golds (one prompt's n completions share a gold)."""
    pred, gold = pred.strip(), gold.strip()
    if not pred or not gold:
        return False
    decided = _trivially_decided(pred, gold)
    if decided is not None:
        return decided
    if gold not in parsed_golds:
        parsed_golds[gold] = _parse(gold, timeout_s)
    return _verify_parsed(parsed_golds[gold], _parse(pred, timeout_s), timeout_s)


def verify(pred: str, gold: str, *, timeout_s: int | None = 5) -> bool:
    """Whether the extracted answer `pred` equals the gold answer `gold` (math-verify; module docstring).

    `timeout_s`: seconds math-verify may spend per parse and per comparison, enforced only in the main
    thread (its alarm is a signal); a timed-out check is False. Empty strings never match.
    """
    return _equal(pred, gold, timeout_s, {})


def compute_rewards(completions: Sequence[str], golds: Sequence[str], style: str, *, timeout_s: int | None = 5) -> list[float]:
    """1.0 for each completion whose extracted answer (`style`) verifies against its gold, else 0.0.

    A completion without an extractable answer scores 0.0. Each distinct gold string is parsed once.
    """
    if len(completions) != len(golds):
        raise ValueError(
            f"{len(completions)} completions but {len(golds)} gold answers: pass one gold per "
            "completion (repeat each prompt's gold n times for n samples)"
        )
    if style not in ANSWER_STYLES:
        raise ValueError(f"unknown answer style {style!r}: use one of {ANSWER_STYLES}")
    parsed_golds: dict[str, object] = {}
    rewards = []
    for text, gold in zip(completions, golds):
        pred = extract_answer(text, style)
        rewards.append(1.0 if pred is not None and _equal(pred, gold, timeout_s, parsed_golds) else 0.0)
    return rewards
