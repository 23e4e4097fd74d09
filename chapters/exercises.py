"""The one check every chapter's exercises call.

An exercise cell sets its answer to `...`; replace the `...` with your answer and run the cell. `check` then prints
"correct" when the answer matches what the package computes, or stops with a hint (never the answer) when it does
not. The package's side of a check may be a function, called only once there is an answer to hold it against.

Each chapter's answers are in solutions/NN_name.py. When PAGED_CHECK_SOLUTIONS is set (chapters/conftest.py sets it
under pytest), a check that finds `...` checks the chapter's written answer instead, silently: the printed output is
the same, and a test fails if an answer and its check disagree.
"""

import importlib.util
import os
from pathlib import Path

SOLUTIONS = Path(__file__).resolve().parent / "solutions"


def unanswered(answer) -> bool:
    return answer is ... or (isinstance(answer, tuple) and any(part is ... for part in answer))


def matches(answer, expected, tolerance: float = 0.0) -> bool:
    """Equal, or within `tolerance` for numbers; tuples part by part."""
    if isinstance(expected, tuple):
        return (
            isinstance(answer, tuple)
            and len(answer) == len(expected)
            and all(matches(a, e, tolerance) for a, e in zip(answer, expected))
        )
    numbers = (int, float)
    if isinstance(expected, numbers) and isinstance(answer, numbers) and not isinstance(expected, bool):
        return abs(answer - expected) <= tolerance
    return answer == expected


def solutions(chapter: str) -> dict:
    """ANSWERS of solutions/<chapter>.py: exercise name -> the answer."""
    spec = importlib.util.spec_from_file_location(f"solutions_{chapter}", SOLUTIONS / f"{chapter}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ANSWERS


class Exercises:
    """The checks of one chapter: `check = Exercises("01_kv_cache").check`, then `check("1", answer_1, expected)`."""

    def __init__(self, chapter: str):
        self.chapter = chapter
        self.answers = solutions(chapter) if os.environ.get("PAGED_CHECK_SOLUTIONS") else None

    def check(self, name: str, answer, expected, tolerance: float = 0.0, hint: str = "") -> None:
        if unanswered(answer):
            print(f"exercise {name}: replace ... with your answer and run the cell again")
            if self.answers is not None:
                self._check_solution(name, expected, tolerance)
            return
        expected = expected() if callable(expected) else expected
        assert matches(answer, expected, tolerance), f"exercise {name}: {answer!r} is not it" + (
            f". Hint: {hint}" if hint else ""
        )
        print(f"exercise {name}: correct")

    def _check_solution(self, name, expected, tolerance):
        assert name in self.answers, f"solutions/{self.chapter}.py has no answer to exercise {name}"
        expected = expected() if callable(expected) else expected
        assert matches(self.answers[name], expected, tolerance), (
            f"solutions/{self.chapter}.py, exercise {name}: {self.answers[name]!r}, but the check computes {expected!r}"
        )
