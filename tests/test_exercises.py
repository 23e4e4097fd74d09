"""The chapters' exercise check (chapters/exercises.py): unanswered, right, wrong with a hint, and the solutions mode
that make test runs every chapter's written answers through."""

import importlib.util
from pathlib import Path

import pytest

CHAPTERS = Path(__file__).resolve().parent.parent / "chapters"
spec = importlib.util.spec_from_file_location("exercises", CHAPTERS / "exercises.py")
exercises = importlib.util.module_from_spec(spec)
spec.loader.exec_module(exercises)


@pytest.fixture
def solutions(tmp_path, monkeypatch):
    (tmp_path / "99_test.py").write_text('ANSWERS = {"1": 42, "2": (3, 0.5)}\n')
    monkeypatch.setattr(exercises, "SOLUTIONS", tmp_path)
    monkeypatch.setenv("PAGED_CHECK_SOLUTIONS", "1")


def test_unanswered_right_and_wrong(capsys, monkeypatch):
    monkeypatch.delenv("PAGED_CHECK_SOLUTIONS", raising=False)
    ex = exercises.Exercises("99_test")
    ex.check("1", ..., 42)
    ex.check("2", (3, ...), (3, 0.5))
    ex.check("3", 0.30000000000000004, 0.3, tolerance=1e-12)
    assert capsys.readouterr().out.splitlines() == [
        "exercise 1: replace ... with your answer and run the cell again",
        "exercise 2: replace ... with your answer and run the cell again",
        "exercise 3: correct",
    ]
    with pytest.raises(AssertionError, match="exercise 1: 41 is not it. Hint: six times seven") as error:
        ex.check("1", 41, 42, hint="six times seven")
    assert "42" not in str(error.value)  # the answer is never shown
    with pytest.raises(AssertionError):
        ex.check("2", (3, 0.6), (3, 0.5), tolerance=0.05)


def test_the_package_side_is_computed_only_for_an_answer(monkeypatch):
    monkeypatch.delenv("PAGED_CHECK_SOLUTIONS", raising=False)
    calls = []
    ex = exercises.Exercises("99_test")
    ex.check("1", ..., lambda: calls.append(1) or 42)
    assert calls == []
    ex.check("1", 42, lambda: calls.append(1) or 42)
    assert calls == [1]


def test_solutions_are_checked_where_the_reader_has_not_answered(solutions, capsys):
    ex = exercises.Exercises("99_test")
    ex.check("1", ..., lambda: 42)
    ex.check("2", ..., (3, 0.51), tolerance=0.02)
    assert capsys.readouterr().out.count("replace ... with your answer") == 2  # the reader sees no difference
    with pytest.raises(AssertionError, match="exercise 1: 42, but the check computes 43"):
        ex.check("1", ..., 43)
    with pytest.raises(AssertionError, match="has no answer to exercise 5"):
        ex.check("5", ..., 1)


def test_every_chapter_with_exercises_has_its_solutions():
    for notebook in sorted(CHAPTERS.glob("[0-9][0-9]_*.ipynb")):
        if "Exercises(" in notebook.read_text():
            assert (CHAPTERS / "solutions" / f"{notebook.stem}.py").exists(), notebook.name
