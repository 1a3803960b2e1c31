"""Answer extraction and math-verify equivalence on GSM8K/MATH-style strings, in and out of the main thread."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from megatron_jetrl.grpo.rewards import compute_rewards, extract_answer, last_boxed, verify

GSM8K_COMPLETION = (
    "Janet's ducks lay 16 eggs per day. She eats 3 and bakes with 4, so 16 - 3 - 4 = 9 eggs are left.\n"
    "She sells them for $2 each: 9 * 2 = $18.\n#### 18"
)
MATH_COMPLETION = (
    "We have $f(-2) = \\frac{8}{4} = 2$, $f(-1) = \\frac{5}{3}$ and $f(0) = 1$, so the sum is "
    "$2 + \\frac{5}{3} + 1 = \\boxed{\\dfrac{14}{3}}$."
)


@pytest.mark.parametrize(
    "text,want",
    [
        (GSM8K_COMPLETION, "18"),
        ("Total: 1234 dollars\n#### 1,234", "1,234"),
        ("#### 5\nso #### 7\n\nQuestion: next one...", "7"),  # the last '####', first line after it
        ("####   42  ", "42"),
        ("the answer is 18", None),
        ("#### \n", None),
    ],
)
def test_extract_gsm8k(text, want):
    assert extract_answer(text, "gsm8k") == want


@pytest.mark.parametrize(
    "text,want",
    [
        (MATH_COMPLETION, "\\dfrac{14}{3}"),
        ("\\boxed{1} then \\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{1}{\\sqrt{2}}"),  # last box, nested braces
        ("so $\\boxed{\\left\\{ 1, 2 \\right\\}}$", "\\left\\{ 1, 2 \\right\\}"),
        ("The answer is $\\boxed 5$.", "5"),
        ("\\fbox{x^{2}}", "x^{2}"),
        ("\\boxed{3} and finally \\boxed{\\frac{1}{2}", None),  # the last box never closes (truncated)
        ("\\boxed{}", None),
        ("no box at all: 5", None),
    ],
)
def test_extract_boxed(text, want):
    assert extract_answer(text, "boxed") == want


@pytest.mark.parametrize(
    "text,want",
    [
        ("82", "82"),
        ("82</s>", "82"),
        (" 119+3", "119"),
        ("-7", "-7"),
        ("8.5x", "8.5"),
        ("007", "007"),
        ("", None),
        ("=82", None),
        ("abc 82", None),
    ],
)
def test_extract_number(text, want):
    assert extract_answer(text, "number") == want


@pytest.mark.parametrize(
    "text,want",
    [
        ("1*7=7,2*7=14", "14"),
        ("1*7=7,2*7=14\n", "14"),
        ("=5", "5"),
        ("1*7=7,2*7", None),
        ("1*7=7,", None),
        ("", None),
        ("14", None),
        ("1*7=7,2*7=-3", "-3"),
    ],
)
def test_extract_final(text, want):
    assert extract_answer(text, "final") == want


def test_last_boxed_edge_cases():
    assert last_boxed("\\boxed{a{b}c}") == "a{b}c"
    assert last_boxed("\\boxed") is None
    assert last_boxed("\\boxed x") == "x"


def test_unknown_style():
    with pytest.raises(ValueError, match="unknown answer style 'latex'.*gsm8k"):
        extract_answer("x", "latex")
    with pytest.raises(ValueError, match="unknown answer style"):
        compute_rewards(["1"], ["1"], "latex")


@pytest.mark.parametrize(
    "pred,gold",
    [
        ("\\frac{1}{2}", "0.5"),
        ("0.5", "\\frac{1}{2}"),
        ("1/2", "\\frac12"),
        ("\\dfrac{3}{4}", "0.75"),
        ("1,234", "1234"),
        ("1234", "1,234"),
        ("5.0", "5"),
        ("007", "7"),
        ("\\frac{\\sqrt3}{2}", "\\frac{\\sqrt{3}}{2}"),
        ("1+x", "x+1"),
        ("A", "\\text{(A)}"),
        ("\\$18", "18"),
        ("\\dfrac{14}{3}", "\\frac{14}{3}"),
        ("\\pi", "\\pi"),
        ("3.14159265", "\\pi"),
    ],
)
def test_verify_equivalent(pred, gold):
    assert verify(pred, gold)


@pytest.mark.parametrize(
    "pred,gold",
    [
        ("83", "82"),
        ("-82", "82"),
        ("0.51", "0.5"),
        ("0.33", "\\frac{1}{3}"),
        ("x", "5"),
        ("", "5"),
        ("5", ""),
        ("\\frac{14}{5}", "\\frac{14}{3}"),
        ("x+2", "x+1"),
        ("B", "\\text{(A)}"),
    ],
)
def test_verify_different(pred, gold):
    assert not verify(pred, gold)


def test_compute_rewards_realistic():
    completions = [GSM8K_COMPLETION, GSM8K_COMPLETION.replace("#### 18", "#### 19"), "I think 18.", "#### 18.00"]
    assert compute_rewards(completions, ["18"] * 4, "gsm8k") == [1.0, 0.0, 0.0, 1.0]
    completions = [MATH_COMPLETION, "\\boxed{4.\\overline{6}}", "$\\boxed{14/3}$", "\\boxed{4.67}", "no answer"]
    assert compute_rewards(completions, ["\\frac{14}{3}"] * 5, "boxed") == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert compute_rewards(["82", "82</s>", "28", "", "8 2"], ["82"] * 5, "number") == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_compute_rewards_length_mismatch():
    with pytest.raises(ValueError, match="2 completions but 1 gold"):
        compute_rewards(["1", "2"], ["1"], "number")


def test_math_verify_defaults_fail_outside_the_main_thread_ours_do_not():
    """The reason for the options: math-verify's default alarm raises in a worker thread."""
    from math_verify import parse

    with ThreadPoolExecutor(1) as pool:
        with pytest.raises(ValueError, match="signal only works in main thread|threaded environment"):
            pool.submit(parse, "$\\frac{1}{2}$").result()
        completions = [MATH_COMPLETION, "\\boxed{0.5}", "\\boxed{1,234}", "\\boxed{x}"]
        golds = ["\\frac{14}{3}", "\\frac{1}{2}", "1234", "5"]
        got = pool.submit(compute_rewards, completions, golds, "boxed").result()
    assert got == compute_rewards(completions, golds, "boxed") == [1.0, 1.0, 1.0, 0.0]


def test_degenerate_answer_is_cut_by_the_timeout_in_the_main_thread():
    assert threading.current_thread() is threading.main_thread()
    start = time.monotonic()
    assert compute_rewards(["\\boxed{10^{10^{10}}}"], ["7"], "boxed", timeout_s=1) == [0.0]
    assert time.monotonic() - start < 10  # without the alarm this does not finish in 120 s
