"""Problem loaders (jsonl/parquet in the public layouts), prompt templates, the arithmetic task, the sampler."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_jetrl.grpo.data import (
    PROMPT_TEMPLATES,
    TEMPLATE_ANSWER_STYLE,
    ArithmeticTask,
    MultiplicationTraceTask,
    Problem,
    PromptSampler,
    format_prompt,
    load_deepmath,
    load_gsm8k,
    load_math,
    load_problems,
    split_heldout,
)
from megatron_jetrl.grpo.rewards import compute_rewards

GSM8K_ROWS = [
    {
        "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips to friends "
        "in May. How many clips did Natalia sell altogether in April and May?",
        "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
        "altogether in April and May.\n#### 72",
    },
    {
        "question": "A store sold 1,200 pens at $1.50 each. How much money did it make?",
        "answer": "1,200 * 1.5 = <<1200*1.5=1800>>1800\n#### 1,800",
    },
]
MATH_ROWS = [
    {
        "problem": "If $f(x) = \\frac{3x-2}{x-2}$, what is the value of $f(-2) +f(-1)+f(0)$? Express your answer as a "
        "common fraction.",
        "solution": "$f(-2)+f(-1)+f(0)=\\frac{-8}{-4}+\\frac{-5}{-3}+\\frac{-2}{-2}=2+\\frac{5}{3}+1=\\boxed{\\frac{14}{3}}$",
        "level": "Level 3",
        "type": "Algebra",
    },
    {
        "problem": "What is the set of solutions of $x^2 = 1$?",
        "solution": "Both signs work, so the answer is $\\boxed{\\{-1, 1\\}}$.",
        "level": "Level 1",
        "type": "Algebra",
    },
]
DEEPMATH_ROWS = [
    {"question": "Evaluate $\\lim_{x \\to 0} \\frac{\\sin x}{x}$.", "final_answer": "1", "difficulty": 2.0},
    {"question": "Find the number of real roots of $x^3 - x$.", "final_answer": 3, "difficulty": 1.5},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize("writer,suffix", [(write_jsonl, ".jsonl"), (write_parquet, ".parquet")])
def test_loaders_read_the_public_layouts(tmp_path, writer, suffix):
    gsm = load_gsm8k(writer(tmp_path / f"train{suffix}", GSM8K_ROWS))
    assert [(p.answer, p.source) for p in gsm] == [("72", "gsm8k"), ("1,800", "gsm8k")]
    assert gsm[0].question == GSM8K_ROWS[0]["question"] and gsm[1].id == f"gsm8k/train{suffix}#1"
    math = load_math(writer(tmp_path / f"math{suffix}", MATH_ROWS))
    assert [p.answer for p in math] == ["\\frac{14}{3}", "\\{-1, 1\\}"]
    deep = load_deepmath(writer(tmp_path / f"deep{suffix}", DEEPMATH_ROWS[:1]))
    assert [(p.question, p.answer) for p in deep] == [(DEEPMATH_ROWS[0]["question"], "1")]


def test_numeric_cells_become_text_and_golds_verify(tmp_path):
    deep = load_deepmath(write_jsonl(tmp_path / "d.jsonl", DEEPMATH_ROWS))
    assert deep[1].answer == "3"
    gsm = load_gsm8k(write_jsonl(tmp_path / "g.jsonl", GSM8K_ROWS))
    assert compute_rewards(["... #### 1800"], [gsm[1].answer], "gsm8k") == [1.0]


def test_directory_reads_all_files_sorted(tmp_path):
    write_parquet(tmp_path / "b.parquet", GSM8K_ROWS[1:])
    write_jsonl(tmp_path / "a.jsonl", GSM8K_ROWS[:1])
    (tmp_path / "README.md").write_text("not data")
    problems = load_problems("gsm8k", str(tmp_path))
    assert [p.id for p in problems] == ["gsm8k/a.jsonl#0", "gsm8k/b.parquet#0"]
    assert [p.answer for p in problems] == ["72", "1,800"]


def test_blank_lines_are_not_rows(tmp_path):
    path = tmp_path / "g.jsonl"
    path.write_text(json.dumps(GSM8K_ROWS[0]) + "\n\n" + json.dumps(GSM8K_ROWS[1]) + "\n")
    assert [p.id for p in load_gsm8k(path)] == ["gsm8k/g.jsonl#0", "gsm8k/g.jsonl#1"]


@pytest.mark.parametrize("writer", [write_jsonl, write_parquet])
def test_missing_column_names_file_and_layout(tmp_path, writer):
    path = writer(tmp_path / ("x.jsonl" if writer is write_jsonl else "x.parquet"), [{"problem": "q", "answer": "1"}])
    with pytest.raises(ValueError, match=r"x\.(jsonl|parquet).*no column 'question'.*openai/gsm8k"):
        load_gsm8k(path)
    with pytest.raises(ValueError, match=r"no column 'solution'.*hendrycks MATH"):
        load_math(path)
    with pytest.raises(ValueError, match=r"no column 'question'.*DeepMath"):
        load_deepmath(path)


@pytest.mark.parametrize("writer", [write_jsonl, write_parquet])
def test_bad_rows_are_named_never_dropped(tmp_path, writer):
    suffix = ".jsonl" if writer is write_jsonl else ".parquet"
    rows = GSM8K_ROWS + [{"question": "Q3", "answer": "no final answer marker"}]
    with pytest.raises(ValueError, match=r"row 2: column 'answer' holds no final answer"):
        load_gsm8k(writer(tmp_path / f"a{suffix}", rows))
    rows = [MATH_ROWS[0], {"problem": "Q", "solution": "unboxed 5", "level": "", "type": ""}]
    with pytest.raises(ValueError, match=r"row 1: column 'solution' holds no final answer.*\\boxed"):
        load_math(writer(tmp_path / f"b{suffix}", rows))
    rows = DEEPMATH_ROWS[:1] + [{"question": "Q", "final_answer": None, "difficulty": 1.0}]
    with pytest.raises(ValueError, match=r"row 1: column 'final_answer' is NoneType"):
        load_deepmath(writer(tmp_path / f"c{suffix}", rows))
    rows = [{"question": "  ", "final_answer": "1", "difficulty": 1.0}]
    with pytest.raises(ValueError, match=r"row 0: column 'question' is empty"):
        load_deepmath(writer(tmp_path / f"d{suffix}", rows))


def test_unreadable_files(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(GSM8K_ROWS[0]) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl row 1 \(line 2\): not valid JSON"):
        load_gsm8k(bad)
    bad.write_text("[1, 2]\n")
    with pytest.raises(ValueError, match=r"row 0 \(line 1\): a JSON list, not an object"):
        load_gsm8k(bad)
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"not parquet")
    with pytest.raises(ValueError, match="junk.parquet: not a readable parquet file"):
        load_gsm8k(junk)
    with pytest.raises(ValueError, match="unsupported file type '.csv'"):
        load_gsm8k(write_jsonl(tmp_path / "x.csv", GSM8K_ROWS))
    with pytest.raises(ValueError, match="does not exist.*not downloaded"):
        load_gsm8k(tmp_path / "missing.jsonl")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="holds no .jsonl or .parquet files"):
        load_math(empty)


def test_load_problems_dispatch(tmp_path):
    arith = load_problems("arithmetic", num_arithmetic=10, seed=3)
    assert arith == ArithmeticTask().problems(10, 3)
    assert load_problems("deepmath", write_jsonl(tmp_path / "d.jsonl", DEEPMATH_ROWS))[1].answer == "3"
    with pytest.raises(ValueError, match="unknown problem source 'aime'.*'arithmetic'.*'gsm8k'"):
        load_problems("aime", "x")
    with pytest.raises(ValueError, match="reads local files: give the path"):
        load_problems("math")
    with pytest.raises(ValueError, match="generated in-process; drop the path"):
        load_problems("arithmetic", "somewhere")


def test_prompt_templates():
    p = Problem("t/0", "What is {x} if x = 2?", "2", "math")
    assert format_prompt(p, "arithmetic") == "What is {x} if x = 2?"
    assert format_prompt(p, "boxed") == (
        "What is {x} if x = 2?\nPlease reason step by step, and put your final answer within \\boxed{}."
    )
    assert format_prompt(p, "gsm8k").endswith('output the final answer after "####".')
    assert set(TEMPLATE_ANSWER_STYLE) == set(PROMPT_TEMPLATES)
    with pytest.raises(ValueError, match=r"unknown prompt template 'chat': use one of \['arithmetic', 'boxed', 'gsm8k'\]"):
        format_prompt(p, "chat")


# ---------------------------------------------------------------------------------------------------------
# arithmetic task


def test_arithmetic_problems_are_correct_and_deterministic():
    task = ArithmeticTask()
    problems = task.problems(500, seed=0)
    assert problems == task.problems(500, seed=0) != task.problems(500, seed=1)
    ops = set()
    for p in problems:
        assert p.question.endswith("=") and p.source == "arithmetic"
        expr = p.question[:-1]
        op = "+" if "+" in expr else "-"
        a, b = (int(x) for x in expr.split(op))
        ops.add(op)
        assert 0 <= a <= 99 and 0 <= b <= 99
        assert p.answer == str(a + b if op == "+" else a - b) and p.answer.isdigit()  # never negative
    assert ops == {"+", "-"}
    assert len({p.id for p in problems}) == 500
    assert task.sft_corpus(5, seed=0) == [p.question + p.answer for p in problems[:5]]
    assert compute_rewards([p.answer for p in problems[:20]], [p.answer for p in problems[:20]], "number") == [1.0] * 20


def test_arithmetic_options():
    task = ArithmeticTask(low=5, high=7, ops=("*", "-"), allow_negative=True)
    problems = task.problems(300, seed=2)
    for p in problems:
        assert eval(p.question[:-1]) == int(p.answer)  # noqa: S307 - our own generated digits and operators
    assert any(p.answer.startswith("-") for p in problems) and any("*" in p.question for p in problems)
    for kw, match in [
        (dict(low=-1), "0 <= low <= high"),
        (dict(low=5, high=4), "0 <= low <= high"),
        (dict(ops=()), "non-empty"),
        (dict(ops=("/",)), "non-empty selection"),
    ]:
        with pytest.raises(ValueError, match=match):
            ArithmeticTask(**kw)


def test_multiplication_trace_task_answers_are_exact_and_lengths_follow_the_multiplier():
    task = MultiplicationTraceTask(operand_max=99, multiplier_min=1, multiplier_max=200)
    problems = task.problems(300, seed=0)
    assert problems == task.problems(300, seed=0) != task.problems(300, seed=1)
    pairs = task.sft_pairs(300, seed=0)
    assert [q for q, _ in pairs] == [p.question for p in problems]
    for p, (_, trace) in zip(problems, pairs):
        a, b = map(int, p.question[:-1].split("*"))
        assert 1 <= a <= 99 and 1 <= b <= 200 and p.answer == str(a * b) and p.source == "multiplication_trace"
        lines = trace.split(",")
        assert lines == [f"{k}*{a}={k * a}" for k in range(1, b + 1)]
    assert MultiplicationTraceTask.trace(7, 3) == "1*7=7,2*7=14,3*7=21"
    assert compute_rewards([t for _, t in pairs[:20]], [p.answer for p in problems[:20]], "final") == [1.0] * 20
    lengths = sorted(len(t) for _, t in pairs)  # characters = tokens of the tiny tokenizer (tests/unit/test_rl_tokenizer.py)
    assert lengths[0] <= 20 and lengths[-1] >= 2000
    with pytest.raises(ValueError, match="1 <= multiplier_min <= multiplier_max"):
        MultiplicationTraceTask(multiplier_min=3, multiplier_max=2)


@settings(max_examples=60, deadline=None)
@given(lo=st.integers(1, 300), span=st.integers(0, 3000), seed=st.integers(0, 2**31))
def test_log_multipliers_stay_in_range(lo, span, seed):
    task = MultiplicationTraceTask(multiplier_min=lo, multiplier_max=lo + span, multiplier_sampling="log")
    bs = [int(p.question[:-1].split("*")[1]) for p in task.problems(50, seed)]
    assert all(lo <= b <= lo + span for b in bs)


def test_log_multipliers_give_each_octave_the_same_share():
    task = MultiplicationTraceTask(multiplier_min=1, multiplier_max=255, multiplier_sampling="log")
    bs = [int(p.question[:-1].split("*")[1]) for p in task.problems(16000, seed=0)]
    octaves = [sum(2**k <= b < 2 ** (k + 1) for b in bs) / len(bs) for k in range(8)]
    assert all(abs(share - 1 / 8) < 0.015 for share in octaves), octaves
    uniform = MultiplicationTraceTask(multiplier_min=1, multiplier_max=255)
    assert uniform.problems(100, seed=0) != task.problems(100, seed=0)
    with pytest.raises(ValueError, match="multiplier_sampling must be 'uniform' or 'log', got 'lin'"):
        MultiplicationTraceTask(multiplier_sampling="lin")


def test_multiplication_trace_tokenizes_one_character_a_token_and_apart_as_together(tmp_path):
    from megatron_jetrl.grpo.tokenizer import UNK_ID, SentencePieceTokenizer, ensure_sentencepiece

    path = tmp_path / "tok.model"
    ensure_sentencepiece(path, ArithmeticTask().sft_corpus(2000, 0), 256)  # the tokenizer the trainer makes
    tok = SentencePieceTokenizer(path)
    for question, trace in MultiplicationTraceTask(operand_max=99, multiplier_max=30).sft_pairs(20, seed=3):
        ids = tok.encode(question + trace)
        assert ids == tok.encode(question) + tok.encode(trace) and len(ids) == len(question + trace)
        assert tok.decode(ids) == question + trace and UNK_ID not in ids


# ---------------------------------------------------------------------------------------------------------
# sampler


def test_sampler_epochs_are_permutations():
    problems = ArithmeticTask().problems(10, seed=0)
    sampler = PromptSampler(problems, prompts_per_step=5, seed=1)
    epoch0 = sampler.next_batch() + sampler.next_batch()
    epoch1 = sampler.next_batch() + sampler.next_batch()
    assert sorted(p.id for p in epoch0) == sorted(p.id for p in problems) == sorted(p.id for p in epoch1)
    assert epoch0 != epoch1 and sampler.state_dict()["epoch"] == 1
    other = PromptSampler(problems, prompts_per_step=5, seed=2)
    assert other.next_batch() + other.next_batch() != epoch0


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 30), st.data(), st.integers(0, 10**6), st.integers(0, 12), st.integers(1, 6))
def test_resumed_sampler_draws_the_same_batches(num, data, seed, before, after):
    problems = ArithmeticTask().problems(num, seed=0)
    per_step = data.draw(st.integers(1, num))
    run = PromptSampler(problems, per_step, seed)
    for _ in range(before):
        run.next_batch()
    state = json.loads(json.dumps(run.state_dict()))  # as a checkpoint would store it
    resumed = PromptSampler(problems, per_step, seed)
    resumed.load_state_dict(state)
    for _ in range(after):
        assert [p.id for p in resumed.next_batch()] == [p.id for p in run.next_batch()]
    drawn = before * per_step
    assert state["epoch"] * num + state["position"] == drawn


def test_sampler_refuses_a_foreign_state():
    problems = ArithmeticTask().problems(8, seed=0)
    state = PromptSampler(problems, 4, seed=0).state_dict()
    with pytest.raises(ValueError, match="saved with seed=0, this sampler has 1"):
        PromptSampler(problems, 4, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="num_problems"):
        PromptSampler(problems[:7], 4, seed=0).load_state_dict(state)
    with pytest.raises(ValueError, match="fingerprint.*same problems"):
        PromptSampler(problems[::-1], 4, seed=0).load_state_dict(state)
    with pytest.raises(ValueError, match="out of range"):
        PromptSampler(problems, 4, seed=0).load_state_dict({**state, "position": 9})
    with pytest.raises(ValueError, match=r"prompts_per_step must be in \[1, 8\]"):
        PromptSampler(problems, 9)
    with pytest.raises(ValueError, match="at least one problem"):
        PromptSampler([], 1)


TASKS = st.one_of(
    st.builds(ArithmeticTask, low=st.integers(0, 3), high=st.integers(4, 12), ops=st.sampled_from(["+", "-", "*", "+-*"])),
    st.builds(
        MultiplicationTraceTask,
        operand_max=st.integers(2, 12),
        multiplier_min=st.integers(1, 3),
        multiplier_max=st.integers(3, 9),
        multiplier_sampling=st.sampled_from(["uniform", "log"]),
    ),
)


@settings(max_examples=60, deadline=None)
@given(task=TASKS, seed=st.integers(0, 2**31), data=st.data())
def test_heldout_questions_never_reach_training_and_draws_are_deterministic(task, seed, data):
    every = {p.question for p in task.problems(4000, seed=1)}
    assert len(every) <= task.num_questions
    held = task.problems(data.draw(st.integers(1, task.num_questions - 1)), seed=seed, distinct=True)
    assert len({p.question for p in held}) == len(held)  # distinct
    exclude = frozenset(p.question for p in held)
    train = task.problems(200, seed=seed + 1, exclude=exclude)
    assert len(train) == 200 and not exclude & {p.question for p in train}
    assert train == task.problems(200, seed=seed + 1, exclude=exclude)
    assert all(q not in exclude for q, _ in task.sft_pairs(50, seed=seed, exclude=exclude))
    assert all(p.answer == str(eval(p.question[:-1])) for p in train)  # still correct answers


def test_num_questions_counts_every_distinct_question():
    for task in (
        ArithmeticTask(low=0, high=6),
        ArithmeticTask(low=2, high=5, ops="-"),
        ArithmeticTask(high=4, ops="-", allow_negative=True),
        MultiplicationTraceTask(operand_max=7, multiplier_min=2, multiplier_max=6),
    ):
        assert len({p.question for p in task.problems(20000, seed=0)}) == task.num_questions
        assert len(task.problems(task.num_questions, seed=3, distinct=True)) == task.num_questions


def test_no_exclusions_keep_the_plain_stream():
    task = MultiplicationTraceTask(operand_max=9, multiplier_max=20, multiplier_sampling="log")
    plain = task.problems(50, seed=4)
    assert plain == task.problems(50, seed=4, exclude=frozenset())
    assert [p.id for p in plain] == [f"multiplication_trace/4/{i}" for i in range(50)]


def test_asking_more_than_the_task_has_is_refused():
    task = MultiplicationTraceTask(operand_max=3, multiplier_max=2)
    with pytest.raises(ValueError, match=r"7 distinct problems asked, but the task has 6 distinct questions and 0 are excluded"):
        task.problems(7, seed=0, distinct=True)
    every = frozenset(p.question for p in task.problems(6, seed=0, distinct=True))
    with pytest.raises(ValueError, match=r"6 are excluded: ask for fewer \(data.heldout\)"):
        task.problems(1, seed=0, exclude=every)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 30), min_size=2, max_size=60), st.randoms(use_true_random=False), st.data())
def test_split_heldout_is_disjoint_and_independent_of_order(values, rnd, data):
    problems = [Problem(f"x/f#{i}", f"q{v}", str(v), "gsm8k") for i, v in enumerate(values)]
    distinct = len(set(values))
    if distinct < 2:
        with pytest.raises(ValueError, match="leaves nothing to train on"):
            split_heldout(problems, 1)
        return
    n = data.draw(st.integers(1, distinct - 1))
    train, held = split_heldout(problems, n)
    assert len(held) == n and len({p.question for p in held}) == n
    assert not {p.question for p in held} & {p.question for p in train}
    assert len(train) + sum(values.count(int(p.question[1:])) for p in held) == len(problems)
    shuffled = problems[:]
    rnd.shuffle(shuffled)
    train2, held2 = split_heldout(shuffled, n)
    assert {p.question for p in held2} == {p.question for p in held} and sorted(p.id for p in train2) == sorted(
        p.id for p in train
    )
