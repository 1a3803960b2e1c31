"""Problems for GRPO: loaders for local GSM8K / MATH / DeepMath files, the embedded arithmetic task,
prompt templates and a resumable prompt sampler.

Loaders read the public column layouts from LOCAL files (nothing is downloaded), `.jsonl` (one JSON
object per line) or `.parquet` (pyarrow), chosen by extension; a directory means all such files in it,
sorted by name. Each row becomes one `Problem` whose `id` is `<source>/<file name>#<row>` (0-based row
among the file's records). A file without a required column, or a row whose value is missing, not text,
or has no final answer raises `ValueError` naming the file, row and column and the layout expected:
rows are never dropped silently.

    gsm8k     openai/gsm8k:            question, answer   (gold = text after the last '####')
    math      hendrycks MATH:          problem, solution  (gold = contents of the last \\boxed{...})
    deepmath  zwhe99/DeepMath-103K:    question, final_answer

The arithmetic task (`ArithmeticTask`) is generated in-process from a seed: the question is the bare
expression `"37+45="` (no chat template, no instruction) and the model is to emit the result's digits and
then EOS. Results are never negative by default (`allow_negative=False`: a subtraction's operands are
ordered so that the larger comes first), so a gold answer is a plain digit string, the whole completion
before EOS is that string, and a tokenizer trained on the corpus never learns an `=-` piece that would
straddle the prompt/answer boundary.

The multiplication-trace task (`MultiplicationTraceTask`) is the long-answer task: the question is `"37*4="` and
the worked answer counts the multiplier up one line at a time, `"1*37=37,2*37=74,3*37=111,4*37=148"`; each line
adds the multiplicand to the previous product, so the answer is meaningful work that a model can check locally
(counter + 1, product + multiplicand, stop when the counter reaches the multiplier), and its length grows linearly
with the multiplier: b lines of 3 + (digits of k, a and k*a) tokens with the tiny tokenizer (every digit, `*`,
`=`, `,` is one token): 5 tokens at a < 10, b=1; ~2400 at a=99, b=200. The reward reads the number after the
last `=` (answer style `final`) and compares it exactly to a*b. Only ASCII digits and `*=,` appear, so the tiny
SentencePiece tokenizer (trained on the arithmetic corpus, every printable ASCII character a piece) encodes it,
and a prompt and its answer tokenize the same apart as together.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatron_jetrl.grpo.rewards import last_boxed


@dataclass(frozen=True)
class Problem:
    """One question with its gold final answer."""

    id: str
    """Unique and stable: `<source>/<file>#<row>` for loaded problems, `arithmetic/<seed>/<index>` for generated."""
    question: str
    """The question text, without any prompt template."""
    answer: str
    """The gold final answer only (e.g. "72", "\\frac{3}{4}"), not a worked solution."""
    source: str
    """"gsm8k", "math", "deepmath", "arithmetic" or "multiplication_trace"."""


# ---------------------------------------------------------------------------------------------------------
# Loaders

LAYOUTS = {
    "gsm8k": "openai/gsm8k (columns 'question', 'answer' with the final answer after '####')",
    "math": "hendrycks MATH / competition_math (columns 'problem', 'solution' with the final answer in \\boxed{...})",
    "deepmath": "zwhe99/DeepMath-103K (columns 'question', 'final_answer')",
}
SUFFIXES = (".jsonl", ".parquet")


def data_files(path: str | Path) -> list[Path]:
    """`path` itself, or the sorted `.jsonl`/`.parquet` files of a directory."""
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.is_file() and f.suffix in SUFFIXES)
        if not files:
            raise ValueError(f"{p} holds no {' or '.join(SUFFIXES)} files; point at a file or a directory of them")
        return files
    if not p.is_file():
        raise ValueError(
            f"{p} does not exist; give a local {' or '.join(SUFFIXES)} file or a directory of them (datasets are not downloaded)"
        )
    if p.suffix not in SUFFIXES:
        raise ValueError(f"{p}: unsupported file type {p.suffix!r}; use {' or '.join(SUFFIXES)}")
    return [p]


def _jsonl_rows(path: Path, columns: Sequence[str], layout: str):
    """(row, {column: value}) for every non-blank line; bad JSON names the line."""
    row = 0
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{path} row {row} (line {lineno}): not valid JSON ({e.msg}); "
                    f"expected one object per line in the {layout} layout"
                ) from None
            if not isinstance(record, dict):
                raise ValueError(
                    f"{path} row {row} (line {lineno}): a JSON {type(record).__name__}, not an object; "
                    f"expected one object per line in the {layout} layout"
                )
            for c in columns:
                if c not in record:
                    raise ValueError(
                        f"{path} row {row} (line {lineno}): no column {c!r} (has {sorted(record)}); expected the {layout} layout"
                    )
            yield row, {c: record[c] for c in columns}
            row += 1


def _parquet_rows(path: Path, columns: Sequence[str], layout: str):
    import pyarrow.parquet as pq

    try:
        names = pq.read_schema(path).names
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a corrupt file
        raise ValueError(f"{path}: not a readable parquet file ({e})") from None
    missing = [c for c in columns if c not in names]
    if missing:
        raise ValueError(f"{path}: no column {missing[0]!r} (has {names}); expected the {layout} layout")
    table = pq.read_table(path, columns=list(columns))
    data = {c: table.column(c).to_pylist() for c in columns}
    for row in range(table.num_rows):
        yield row, {c: data[c][row] for c in columns}


def _text(value, path: Path, row: int, column: str, layout: str) -> str:
    """The cell as a non-empty string (numbers are accepted and printed), else a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(
            f"{path} row {row}: column {column!r} is {type(value).__name__} {value!r:.60}, not text; expected the {layout} layout"
        )
    text = str(value).strip()
    if not text:
        raise ValueError(f"{path} row {row}: column {column!r} is empty; expected the {layout} layout")
    return text


def _gsm8k_answer(solution: str) -> str | None:
    i = solution.rfind("####")
    if i < 0:
        return None
    return solution[i + 4 :].strip() or None


def _load(source: str, path: str | Path, question_col: str, answer_col: str, final_answer) -> list[Problem]:
    """Rows of every file under `path` -> Problems; `final_answer(cell) -> str | None` reads the gold."""
    layout = LAYOUTS[source]
    problems = []
    for file in data_files(path):
        rows = _parquet_rows if file.suffix == ".parquet" else _jsonl_rows
        for row, cells in rows(file, (question_col, answer_col), layout):
            question = _text(cells[question_col], file, row, question_col, layout)
            answer = final_answer(_text(cells[answer_col], file, row, answer_col, layout))
            if answer is None:
                raise ValueError(
                    f"{file} row {row}: column {answer_col!r} holds no final answer "
                    f"({cells[answer_col]!r:.80}); expected the {layout} layout"
                )
            problems.append(Problem(f"{source}/{file.name}#{row}", question, answer, source))
    return problems


def load_gsm8k(path: str | Path) -> list[Problem]:
    """openai/gsm8k rows (`question`, `answer` ending in `#### <final>`) from a local file or directory."""
    return _load("gsm8k", path, "question", "answer", _gsm8k_answer)


def load_math(path: str | Path) -> list[Problem]:
    """Hendrycks MATH rows (`problem`, `solution` with the final `\\boxed{...}`) from a local file or directory."""
    return _load("math", path, "problem", "solution", lambda s: (last_boxed(s) or "").strip() or None)


def load_deepmath(path: str | Path) -> list[Problem]:
    """zwhe99/DeepMath-103K rows (`question`, `final_answer`) from a local file or directory."""
    return _load("deepmath", path, "question", "final_answer", lambda s: s)


# ---------------------------------------------------------------------------------------------------------
# The embedded arithmetic task


@dataclass(frozen=True)
class ArithmeticTask:
    """Integer problems `"<a><op><b>="` with operands in [low, high], generated from a seed (module docstring)."""

    low: int = 0
    """Smallest operand (>= 0, so a question never reads "3+-5=")."""
    high: int = 99
    """Largest operand."""
    ops: tuple[str, ...] = ("+", "-")
    """Operators drawn uniformly: any of "+", "-", "*"."""
    allow_negative: bool = False
    """False: a subtraction puts the larger operand first, so every gold answer is a plain digit string."""

    def __post_init__(self):
        object.__setattr__(self, "ops", tuple(self.ops))
        problems = []
        if not 0 <= self.low <= self.high:
            problems.append(f"operand range must satisfy 0 <= low <= high, got low={self.low}, high={self.high}")
        if not self.ops or any(op not in "+-*" or len(op) != 1 for op in self.ops):
            problems.append(f"ops must be a non-empty selection of '+', '-', '*', got {self.ops!r}")
        if problems:
            raise ValueError("invalid ArithmeticTask: " + "; ".join(problems))

    def _draw(self, rng: random.Random) -> tuple[str, str]:
        a, b = rng.randint(self.low, self.high), rng.randint(self.low, self.high)
        op = rng.choice(self.ops)
        if op == "-" and not self.allow_negative and a < b:
            a, b = b, a
        result = a + b if op == "+" else a - b if op == "-" else a * b
        return f"{a}{op}{b}=", str(result)

    @property
    def num_questions(self) -> int:
        """How many distinct questions the task can draw."""
        m = self.high - self.low + 1
        return sum(m * (m + 1) // 2 if op == "-" and not self.allow_negative else m * m for op in set(self.ops))

    def problems(self, n: int, seed: int, *, exclude: frozenset[str] = frozenset(), distinct: bool = False) -> list[Problem]:
        """`n` problems drawn with `random.Random(seed)` (the same for the same task, n, seed and exclusions), none
        whose question is in `exclude`, each question once when `distinct` (`draw_problems`)."""
        return draw_problems(lambda rng: self._draw(rng), n, seed, "arithmetic", self.num_questions, exclude, distinct)

    def sft_corpus(self, n: int, seed: int) -> list[str]:
        """`n` full strings question+answer (`"37+45=82"`): tokenizer training text."""
        return [p.question + p.answer for p in self.problems(n, seed)]

    def sft_pairs(self, n: int, seed: int, *, exclude: frozenset[str] = frozenset()) -> list[tuple[str, str]]:
        """`n` (question, answer) pairs (`("37+45=", "82")`): the supervised warm-start's sequences."""
        return [(p.question, p.answer) for p in self.problems(n, seed, exclude=exclude)]


@dataclass(frozen=True)
class MultiplicationTraceTask:
    """`"<a>*<b>="` answered by the trace `"1*a=a,2*a=2a,...,b*a=ab"` (module docstring), generated from a seed."""

    operand_max: int = 9
    """The multiplicand a is drawn from [1, operand_max]."""
    multiplier_min: int = 1
    """Smallest multiplier b = the fewest lines of a worked answer."""
    multiplier_max: int = 8
    """Largest multiplier b: the answer's length (lines) is drawn from [multiplier_min, multiplier_max]."""
    multiplier_sampling: str = "uniform"
    """`uniform`: b uniform in that range; `log`: log(b) uniform (each octave of lengths equally likely)."""

    def __post_init__(self):
        if not 1 <= self.operand_max or not 1 <= self.multiplier_min <= self.multiplier_max:
            raise ValueError(
                "invalid MultiplicationTraceTask: need operand_max >= 1 and 1 <= multiplier_min <= "
                f"multiplier_max, got operand_max={self.operand_max}, multiplier_min={self.multiplier_min}, "
                f"multiplier_max={self.multiplier_max}"
            )
        if self.multiplier_sampling not in ("uniform", "log"):
            raise ValueError(
                f"invalid MultiplicationTraceTask: multiplier_sampling must be 'uniform' or 'log', got "
                f"{self.multiplier_sampling!r}"
            )

    def multiplier(self, rng: random.Random) -> int:
        """One b: uniform, or log-uniform over [multiplier_min, multiplier_max + 1) floored (`multiplier_sampling`)."""
        if self.multiplier_sampling == "uniform":
            return rng.randint(self.multiplier_min, self.multiplier_max)
        lo, hi = math.log(self.multiplier_min), math.log(self.multiplier_max + 1)
        return min(int(math.exp(rng.uniform(lo, hi))), self.multiplier_max)  # exp(hi) itself can come back from rounding

    @staticmethod
    def trace(a: int, b: int) -> str:
        """The worked answer of `a*b=`: one line `k*a=<k*a>` per k = 1..b, comma-separated."""
        return ",".join(f"{k}*{a}={k * a}" for k in range(1, b + 1))

    @property
    def num_questions(self) -> int:
        """How many distinct questions the task can draw."""
        return self.operand_max * (self.multiplier_max - self.multiplier_min + 1)

    def _draw(self, rng: random.Random) -> tuple[str, str]:
        a = rng.randint(1, self.operand_max)
        b = self.multiplier(rng)
        return f"{a}*{b}=", str(a * b)

    def problems(self, n: int, seed: int, *, exclude: frozenset[str] = frozenset(), distinct: bool = False) -> list[Problem]:
        """`n` problems drawn with `random.Random(seed)`, none in `exclude`, each once when `distinct`
        (`draw_problems`); the gold answer is the product only."""
        return draw_problems(self._draw, n, seed, "multiplication_trace", self.num_questions, exclude, distinct)

    def sft_pairs(self, n: int, seed: int, *, exclude: frozenset[str] = frozenset()) -> list[tuple[str, str]]:
        """`n` (question, worked answer) pairs: the supervised warm-start teaches the trace format."""
        return [(p.question, self.trace(*map(int, p.question[:-1].split("*")))) for p in self.problems(n, seed, exclude=exclude)]


def draw_problems(
    draw, n: int, seed: int, source: str, num_questions: int, exclude: frozenset[str] = frozenset(), distinct: bool = False
) -> list[Problem]:
    """`n` problems from `draw(rng)` -> (question, answer) with `random.Random(seed)`, ids `<source>/<seed>/<i>`. A
    question in `exclude` (a held-out set) is drawn again, and so is a repeat when `distinct`; without either the
    draws are the task's plain stream. Asking for more than the task has left (`num_questions` minus the exclusions,
    when distinct) is refused before drawing."""
    left = num_questions - len(exclude)
    if left <= 0 or distinct and n > left:
        raise ValueError(
            f"{source}: {n} {'distinct ' if distinct else ''}problems asked, but the task has "
            f"{num_questions} distinct questions and {len(exclude)} are excluded: ask for fewer (data.heldout) "
            "or widen the task (data.operand_max, data.multiplier_max)"
        )
    rng, seen, problems = random.Random(seed), set(exclude), []
    while len(problems) < n:
        question, answer = draw(rng)
        if question in seen:
            continue
        if distinct:
            seen.add(question)
        problems.append(Problem(f"{source}/{seed}/{len(problems)}", question, answer, source))
    return problems


HELDOUT_SEED = 999_331
"""The generated tasks' held-out problems are drawn with this seed, not run.seed: every run of one data config (any
seed, the SFT run and the GRPO runs after it) scores the same held-out questions."""


def split_heldout(problems: Sequence[Problem], n: int) -> tuple[list[Problem], list[Problem]]:
    """(training, held-out) of loaded problems: the held-out set is the `n` distinct questions whose SHA-256 is
    smallest (one problem each; independent of file order and seed), and training keeps every problem whose
    question is not one of them."""
    questions = sorted({p.question for p in problems}, key=lambda q: hashlib.sha256(q.encode()).digest())
    if n >= len(questions):
        raise ValueError(
            f"data.heldout={n} leaves nothing to train on: the dataset has {len(questions)} distinct questions; hold out fewer"
        )
    held = set(questions[:n])
    first = {}
    for p in problems:
        if p.question in held:
            first.setdefault(p.question, p)
    return [p for p in problems if p.question not in held], sorted(first.values(), key=lambda p: p.id)


def load_problems(source: str, path: str | Path | None = None, *, num_arithmetic: int = 4096, seed: int = 0) -> list[Problem]:
    """Problems of `source`: "gsm8k", "math", "deepmath" (from the local `path`) or "arithmetic"
    (`num_arithmetic` problems of the default `ArithmeticTask`, drawn with `seed`; no path)."""
    loaders = {"gsm8k": load_gsm8k, "math": load_math, "deepmath": load_deepmath}
    if source == "arithmetic":
        if path is not None:
            raise ValueError(f"the arithmetic task is generated in-process; drop the path ({path!r})")
        return ArithmeticTask().problems(num_arithmetic, seed)
    if source not in loaders:
        raise ValueError(f"unknown problem source {source!r}: use one of {sorted([*loaders, 'arithmetic'])}")
    if path is None:
        raise ValueError(
            f"source {source!r} reads local files: give the path of a {' or '.join(SUFFIXES)} file "
            f"or directory in the {LAYOUTS[source]} layout (datasets are not downloaded)"
        )
    return loaders[source](path)


# ---------------------------------------------------------------------------------------------------------
# Prompts

PROMPT_TEMPLATES: dict[str, str] = {
    "gsm8k": '{question}\nLet\'s think step by step and output the final answer after "####".',
    "boxed": "{question}\nPlease reason step by step, and put your final answer within \\boxed{{}}.",
    "arithmetic": "{question}",
}
"""Template name -> `str.format` pattern with one field, `{question}`. Plain text: a chat template, if the
model wants one, is applied by the caller on top."""

TEMPLATE_ANSWER_STYLE: dict[str, str] = {"gsm8k": "gsm8k", "boxed": "boxed", "arithmetic": "number"}
"""The `rewards.extract_answer` style that reads an answer written as each template asks."""

DEFAULT_TEMPLATE: dict[str, str] = {
    "gsm8k": "gsm8k",
    "math": "boxed",
    "deepmath": "boxed",
    "arithmetic": "arithmetic",
    "multiplication_trace": "arithmetic",
}
"""The template each problem source is usually trained with."""


def format_prompt(problem: Problem, template: str) -> str:
    """The prompt text for `problem` in the named template (`PROMPT_TEMPLATES`)."""
    if template not in PROMPT_TEMPLATES:
        raise ValueError(f"unknown prompt template {template!r}: use one of {sorted(PROMPT_TEMPLATES)}")
    return PROMPT_TEMPLATES[template].format(question=problem.question)


# ---------------------------------------------------------------------------------------------------------
# Sampling prompts


def _fingerprint(problems: Sequence[Problem]) -> str:
    return hashlib.sha256("\n".join(p.id for p in problems).encode()).hexdigest()[:16]


class PromptSampler:
    """Batches of `prompts_per_step` problems in shuffled epochs, resumable exactly.

    Epoch e visits every problem once in the order `numpy.random.default_rng([seed, e]).permutation(N)`;
    a batch that reaches the end of an epoch continues into the next one, so no problem is skipped (such a
    batch can hold one problem twice, once from each epoch).
    `state_dict()` is (epoch, position) plus a fingerprint of the problem ids; loading it into a sampler
    over the same problems and seed makes `next_batch()` return exactly what the saved run would have.
    """

    def __init__(self, problems: Sequence[Problem], prompts_per_step: int, seed: int = 0):
        if not problems:
            raise ValueError("PromptSampler needs at least one problem")
        if not 1 <= prompts_per_step <= len(problems):
            raise ValueError(f"prompts_per_step must be in [1, {len(problems)}] (the number of problems), got {prompts_per_step}")
        self.problems = list(problems)
        self.prompts_per_step = prompts_per_step
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)
        self._fingerprint = _fingerprint(self.problems)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.problems))

    def next_batch(self) -> list[Problem]:
        """The next `prompts_per_step` problems."""
        batch = []
        while len(batch) < self.prompts_per_step:
            if self.position == len(self.problems):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            take = min(self.prompts_per_step - len(batch), len(self.problems) - self.position)
            batch += [self.problems[i] for i in self._order[self.position : self.position + take]]
            self.position += take
        return batch

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_problems": len(self.problems),
            "fingerprint": self._fingerprint,
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume at `state`'s (epoch, position); refuses a state saved over other problems or another seed."""
        mine = self.state_dict()
        for key in ("seed", "num_problems", "fingerprint"):
            if state.get(key) != mine[key]:
                raise ValueError(
                    f"sampler state was saved with {key}={state.get(key)!r}, this sampler has "
                    f"{mine[key]!r}: resume with the same problems (same files, same order) and seed"
                )
        if not 0 <= state["position"] <= len(self.problems) or state["epoch"] < 0:
            raise ValueError(
                f"sampler state out of range: epoch {state['epoch']}, position {state['position']} of {len(self.problems)}"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation(self.epoch)
