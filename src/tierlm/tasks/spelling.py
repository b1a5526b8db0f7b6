"""Synthetic spelling and counting (nanochat's SpellingBee): "How many r are in strawberry?", answered by spelling
the word out and counting, so a small model learns what its tokenizer hides (a word is one token, its letters are
not). Words come from the list shipped beside this file (the words of Tiny Shakespeare); a stable tenth of them
is the validation split, never trained on. Every kind of example, as `synthetic:spelling`: text, chats, pairs
(the right count over one off by one) and rewarded prompts (exact number).
"""

from __future__ import annotations

import functools
import random
import zlib
from dataclasses import dataclass
from pathlib import Path

from tierlm.tasks.base import WorkedProblem

QUESTIONS = (
    "How many {letter} are in {word}?",
    "How many times does the letter {letter} appear in {word}?",
    "Count the letter {letter} in the word {word}.",
    "In the word {word}, how many {letter}s are there?",
)


@functools.cache
def words() -> tuple[str, ...]:
    return tuple((Path(__file__).parent / "words.txt").read_text().split())


@functools.cache
def split_words(validation: bool, modulus: int) -> tuple[str, ...]:
    """The words of one split: a stable `1 / modulus` of them (by CRC-32) is the validation split."""
    return tuple(w for w in words() if (zlib.crc32(w.encode()) % modulus == 0) == validation)


@dataclass(frozen=True)
class SpellingProblem(WorkedProblem):
    word: str
    letter: str
    template: int = 0

    @property
    def result(self) -> int:
        return self.word.count(self.letter)

    @property
    def question(self) -> str:
        return QUESTIONS[self.template].format(letter=self.letter, word=self.word)

    def answer_with(self, count: int) -> str:
        spelled = ",".join(self.word)
        times = "time" if count == 1 else "times"
        return f"{self.word} is spelled {spelled}. The letter {self.letter} appears {count} {times}.\n#### {count}"

    @property
    def answer(self) -> str:
        return self.answer_with(self.result)


@dataclass(frozen=True)
class SpellingTask:
    """Problem i of a split is a pure function of (seed, split, i).

    >>> p = SpellingTask().problem("train", 0, seed=0)
    >>> p.question.count(p.word), p.result == p.word.count(p.letter), p.answer.endswith(f"#### {p.result}")
    (1, True, True)
    """

    present: float = 0.8
    """Share of questions about a letter the word has (the rest: a letter it lacks, answer 0)."""
    val_modulus: int = 10

    def problem(self, split: str, index: int, seed: int) -> SpellingProblem:
        assert split in ("train", "val"), f"split must be 'train' or 'val', got {split!r}"
        rng = random.Random(f"{seed}/spelling/{split}/{index}")
        word = rng.choice(split_words(split == "val", self.val_modulus))
        if rng.random() < self.present:
            letter = rng.choice(word)
        else:
            letter = rng.choice([c for c in "abcdefghijklmnopqrstuvwxyz" if c not in word] or list(word))
        return SpellingProblem(word, letter, rng.randrange(len(QUESTIONS)))

    def conversation(self, split: str, index: int, seed: int) -> list[dict]:
        return self.problem(split, index, seed).conversation

    def preference(self, split: str, index: int, seed: int) -> tuple[list[dict], list[dict]]:
        """(chosen, rejected): the right count over one off by one."""
        problem = self.problem(split, index, seed)
        wrong = problem.result + (1 if problem.result == 0 or random.Random(f"{seed}/{index}").random() < 0.5 else -1)
        rejected = [problem.conversation[0], {"role": "assistant", "content": problem.answer_with(wrong)}]
        return problem.conversation, rejected

    def problems(self, split: str, count: int, seed: int) -> list[SpellingProblem]:
        return [self.problem(split, i, seed) for i in range(count)]
