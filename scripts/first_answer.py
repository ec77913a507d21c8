"""The first answer a newcomer sees (issue 35 item 1): how often SmolLM2 answers four simple
questions right in its first 32 tokens, per system prompt, at its card's sampling (T 0.2, top-p
0.9), over seeds 0..N-1; and the first token's top candidates after top-p.

    PYTHONPATH=. .venv/bin/python scripts/first_answer.py [--seeds 12]

A system prompt of None is the chat template's own (SmolLM2's names itself SmolLM).
"""

import argparse
import re

from engine import DEFAULT_MODEL, models
from engine.events import TokenSampled, TurnFinished
from engine.sampling import SamplingSettings
from engine.session import ChatSession
from tui.options import BUILT_IN_SYSTEM

QUESTIONS = (
    ("What is the capital of France?", "Paris"),
    ("What is two plus two?", r"\b(4|four)\b"),
    ("Name three primary colors.", "(?i)red"),
    ("Why is the sky blue?", "(?i)scatter"),
)
SYSTEMS = (
    None,
    BUILT_IN_SYSTEM,
    "You are a helpful assistant. Answer briefly.",
    "You are a helpful assistant.",
)


def answer(loaded, system: str | None, question: str, seed: int) -> tuple[str, list]:
    sampling = SamplingSettings(temperature=0.2, top_p=0.9, seed=seed, max_new_tokens=32)
    session = ChatSession(loaded, sampling, system_prompt=system, compile=False)
    text, first = "", []
    for event in session.send(question):
        if isinstance(event, TokenSampled) and event.index == 0:
            first = [(c.piece, round(c.prob, 3)) for c in event.top_k[:3]]
        elif isinstance(event, TurnFinished):
            text = event.text
    return text, first


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=12)
    seeds = parser.parse_args().seeds
    loaded = models.load(DEFAULT_MODEL, "fp32", "cpu")
    for system in SYSTEMS:
        right, first = {}, []
        for question, pattern in QUESTIONS:
            answers = [answer(loaded, system, question, seed) for seed in range(seeds)]
            right[question] = sum(bool(re.search(pattern, text)) for text, _ in answers)
            first = first or answers[0][1]
        print(f"system {system!r}: right of {seeds}: {right}; first token of the capital's answer: {first}")


if __name__ == "__main__":
    main()
