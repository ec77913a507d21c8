"""Shared checks for the int8 precisions (w8a8, w8): the tiny model's fast path against its
reference forward, and SmolLM2's answer against fp32."""

from __future__ import annotations

from engine import models
from engine.events import TokenSampled
from engine.instruments.precision_compare import PrecisionComparison, compare_precisions
from engine.sampling import SamplingSettings
from engine.session import ChatSession


def greedy_tokens(model_dir, precision: str, fast: bool) -> list[int]:
    """A fresh load's greedy answer, through the fast path or the HF reference forward."""
    settings = SamplingSettings(temperature=0.0, max_new_tokens=16)
    session = ChatSession(models.load(str(model_dir), precision, "cpu"), settings, fast=fast)
    assert (session.fast is not None) == fast
    return [e.id for e in session.send("How does inference work?") if isinstance(e, TokenSampled)]


def answer_against_fp32(
    fp32: models.LoadedModel, loaded: models.LoadedModel
) -> tuple[str, PrecisionComparison]:
    """SmolLM2's greedy answer to the capital question at `loaded`'s precision, and how its
    next-token distributions compare with fp32's over that turn (teacher-forced)."""
    session = ChatSession(loaded, SamplingSettings(temperature=0.0, max_new_tokens=24))
    assert session.fast is not None
    answer = list(session.send("What is the capital of France?"))[-1].text
    reference = ChatSession(fp32)
    reference.messages = list(session.messages[:1])
    ids = reference.template(reference.messages)
    return answer, compare_precisions(fp32, loaded, ids, max_new_tokens=24, stop_ids=session.stop_ids)
