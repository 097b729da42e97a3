"""Retrieval tasks for long contexts, generated offline: passkey and RULER-style needles in a haystack.

A task hides one or more *needles* (short sentences holding a value) in a *haystack* (any token stream, e.g.
held-out text) and ends with a question whose answer is the value of one of them; a model answers by greedy
``generate()`` through its own cache, and the answer is scored by exact match. Tasks (Mohtashami & Jaggi 2023
for the passkey; Hsieh et al. 2024, RULER, §3 for the rest):

- ``passkey``: one 5-digit pass key; the question asks for it;
- ``needle``: one "special magic number" (7 digits) for a random key (RULER's ``niah_single``);
- ``multikey``: four needles with distinct keys and values, one of them asked (RULER's ``niah_multikey``):
  the others, at random depths, are distractors;
- ``variables``: a chain of four assignments ``VAR A = 12345``, ``VAR B = VAR A``, ...; the question asks for
  every variable holding the value, in chain order (RULER's variable tracking, one chain).

Prompts are built in token space, so a prompt of length ``T`` has exactly ``T`` tokens: the tokens the
tokenizer puts before a text (a BOS where it adds one), the instruction, ``T - template`` haystack tokens
(from a seeded offset, the stream repeated when it is shorter) with the needles inserted, and the question,
which ends with the start of the answer ("The pass key is"), so a base model answers by continuing it. The
asked needle sits at ``depth`` of the haystack (0: its start, 1: its end, before the question), moved to the
nearest sentence end within 5% of the haystack; the depth it got is recorded. Values are redrawn until the
answer occurs exactly once in the decoded prompt. Every sample is a function of (seed, task, length, depth,
index) alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from lrkv_core.cache import cache_kwargs
from lrkv_core.data.datasets import text_prefix

TASKS = ("passkey", "needle", "multikey", "variables")
INTRO = "There is important information hidden inside a lot of irrelevant text. Find it and memorize it.\n\n"
SNAP = 0.05  # a needle moves at most this share of the haystack to reach a sentence end
_ENDS = (".", "!", "?", "\n")
_ADJECTIVES = (
    "amber brave calm damp eager faint gentle hollow icy jolly keen lively mellow noble odd pale quiet rapid "
    "silent tidy upper vivid warm young zesty bitter crisp dusty early fuzzy grand humble"
).split()
_NOUNS = (
    "anchor barrel candle dragon engine falcon garden harbor island jacket kettle lantern meadow needle "
    "orchard pillow quarry river saddle tunnel violin walnut yarrow zephyr basket cellar donkey feather "
    "glacier hammer"
).split()
_LETTERS = np.array(list("ABCDEFGHIJKLMNOPQRSTUVWXYZ"))


class PromptTooShort(ValueError):
    """A prompt length the task's template (instruction, needles, question) does not fit in."""


@dataclass(frozen=True)
class NeedleSample:
    """One retrieval prompt: (T,) ``input_ids``, the ``answer`` text and where the asked needle sits.

    ``needle_start``/``needle_len`` locate the asked needle's tokens in ``input_ids``; ``actual_depth`` is the
    number of haystack tokens before it over the ``haystack_len`` haystack tokens (``depth``: the one asked);
    the last ``question_len`` tokens are the question (what a reader that compresses the context alone, as
    kvpress's pipeline does, keeps apart).
    """

    task: str
    length: int
    depth: float
    index: int
    input_ids: torch.Tensor
    answer: str
    needle_start: int
    needle_len: int
    actual_depth: float
    haystack_len: int
    question_len: int


def _key(rng: np.random.Generator) -> str:
    return f"{_ADJECTIVES[rng.integers(len(_ADJECTIVES))]}-{_NOUNS[rng.integers(len(_NOUNS))]}"


def _number(rng: np.random.Generator, digits: int) -> str:
    return str(rng.integers(10 ** (digits - 1), 10**digits))


def _distinct(draw, n: int) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        item = draw()
        if item not in out:
            out.append(item)
    return out


def _content(task: str, rng: np.random.Generator) -> tuple[list[str], str, str, str]:
    """(needle texts, the asked one first; question; answer; the value that must occur once in the context)
    of one sample of ``task``."""
    if task == "passkey":
        value = _number(rng, 5)
        needle = f" The pass key is {value}. Remember it. "
        return [needle], "\n\nWhat is the pass key? The pass key is", value, value
    if task in ("needle", "multikey"):
        keys = _distinct(lambda: _key(rng), 1 if task == "needle" else 4)
        values = _distinct(lambda: _number(rng, 7), len(keys))
        needles = [f" One of the special magic numbers for {k} is: {v}. " for k, v in zip(keys, values)]
        phrase = f"the special magic number for {keys[0]} mentioned in the provided text"
        return needles, f"\n\nWhat is {phrase}? {phrase[0].upper()}{phrase[1:]} is", values[0], values[0]
    if task == "variables":
        value = _number(rng, 5)
        names = _distinct(lambda: "".join(rng.choice(_LETTERS, 5)), 4)
        needles = [f" VAR {names[0]} = {value}. "] + [
            f" VAR {b} = VAR {a}. " for a, b in zip(names, names[1:])
        ]
        question = (
            f"\n\nFind all variables that are assigned the value {value} in the text above. Answer: "
            "According to the chain of variable assignment in the text above, 4 variables are assigned the "
            f"value {value}, they are:"
        )
        return needles, question, " ".join(names), value
    raise ValueError(f"unknown retrieval task {task!r}; known: {', '.join(TASKS)}")


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])


def _snap(position: int, ends: np.ndarray, budget: int) -> int:
    """The sentence end (an index after a token ending one; 0 and ``budget`` always count) nearest to
    ``position`` within ``SNAP`` of the haystack, else ``position`` itself."""
    candidates = np.concatenate([[0, budget], ends])
    best = candidates[np.argmin(np.abs(candidates - position))]
    return int(best) if abs(int(best) - position) <= SNAP * budget else position


def _sentence_ends(tokenizer: Any, hay: np.ndarray) -> np.ndarray:
    """Indices i of ``hay`` (T,) whose previous token's text ends a sentence."""
    unique = np.unique(hay)
    ending = {int(t) for t in unique if tokenizer.decode([int(t)]).rstrip(" ").endswith(_ENDS)}
    return np.flatnonzero(np.isin(hay, list(ending))) + 1


def make_sample(
    task: str, tokenizer: Any, haystack: torch.Tensor, *, length: int, depth: float, seed: int, index: int = 0
) -> NeedleSample:
    """One prompt of exactly ``length`` tokens, the asked needle at ``depth`` of a ``haystack`` (S,) slice.

    Raises ``ValueError`` for a depth outside [0, 1], a length the template does not fit in, or an empty
    haystack.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    stream = haystack.reshape(-1).numpy()
    if stream.size == 0:
        raise ValueError("the haystack has no tokens")
    if task not in TASKS:
        raise ValueError(f"unknown retrieval task {task!r}; known: {', '.join(TASKS)}")
    rng = np.random.default_rng([seed, TASKS.index(task), length, round(depth * 1e6), index])
    prefix = text_prefix(tokenizer) + _encode(tokenizer, INTRO)
    for _ in range(50):
        needles, question, answer, value = _content(task, rng)
        needle_ids = [_encode(tokenizer, n) for n in needles]
        question_ids = _encode(tokenizer, question)
        budget = length - len(prefix) - sum(map(len, needle_ids)) - len(question_ids)
        if budget < 1:
            raise PromptTooShort(
                f"{task}: a {length}-token prompt does not fit the template ({length - budget} tokens)"
            )
        offset = int(rng.integers(stream.size))
        hay = stream[(offset + np.arange(budget)) % stream.size]  # (budget,) from offset, wrapping around
        ends = _sentence_ends(tokenizer, hay)
        asked = _snap(round(depth * budget), ends, budget)
        if task == "multikey":  # distractors anywhere
            others = [_snap(int(rng.integers(budget + 1)), ends, budget) for _ in needle_ids[1:]]
        elif task == "variables":  # the chain after the value, evenly to the end
            steps = [
                round(asked + (budget - asked) * (i + 1) / len(needle_ids))
                for i in range(len(needle_ids) - 1)
            ]
            others = [max(asked, _snap(pos, ends, budget)) for pos in steps]
        else:
            others = []
        ids, start, cut = list(prefix), 0, 0
        for pos, k in sorted(zip([asked, *others], range(len(needle_ids)))):  # by position, then chain order
            ids += hay[cut:pos].tolist()
            cut = pos
            start = len(ids) if k == 0 else start
            ids += needle_ids[k]
        ids += hay[cut:].tolist()
        if tokenizer.decode(ids).count(value) == 1:  # the context holds the value once
            ids += question_ids
            return NeedleSample(
                task=task,
                length=length,
                depth=depth,
                index=index,
                input_ids=torch.tensor(ids, dtype=torch.long),
                answer=answer,
                needle_start=start,
                needle_len=len(needle_ids[0]),
                actual_depth=asked / budget,
                haystack_len=budget,
                question_len=len(question_ids),
            )
    raise ValueError(f"{task}: no value drawn occurs exactly once in the prompt (50 tries)")


def make_samples(
    task: str, tokenizer: Any, haystack: torch.Tensor, *, length: int, depth: float, samples: int, seed: int
) -> list[NeedleSample]:
    """``samples`` prompts of one (task, length, depth) cell (see :func:`make_sample`)."""
    return [
        make_sample(task, tokenizer, haystack, length=length, depth=depth, seed=seed, index=i)
        for i in range(samples)
    ]


def is_exact_match(output: str, answer: str) -> bool:
    """Whether the generated text, leading whitespace stripped, is ``answer`` followed by nothing or by a
    character that cannot continue it (not a letter or digit): "68231." matches 68231, "682310" does not."""
    text = output.lstrip()
    return text.startswith(answer) and (len(text) == len(answer) or not text[len(answer)].isalnum())


def answer_tokens(tokenizer: Any, answer: str) -> int:
    """New tokens to generate for ``answer``: its tokens after a space, plus two."""
    return len(_encode(tokenizer, " " + answer)) + 2


def generate_answer(
    model: nn.Module, tokenizer: Any, sample: NeedleSample, *, cache_factory: Any = None
) -> str:
    """Greedy ``generate()`` of the answer through the model's cache (or ``cache_factory()``), decoded."""
    device = next(model.parameters()).device
    ids = sample.input_ids[None].to(device)  # (1, T)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    extra = {} if cache_factory is None else cache_kwargs(cache_factory())
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=answer_tokens(tokenizer, sample.answer),
        min_new_tokens=0,
        do_sample=False,
        num_beams=1,
        repetition_penalty=1.0,
        pad_token_id=pad,
        **extra,
    )  # (1, T + new)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
