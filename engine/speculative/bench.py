"""`llmchat bench --speculative ...`: decode tok/s with and without speculation, same prompts, same run.

Greedy, so both sides produce the same answer (checked: `identical`); each repeat runs plain then
speculative on each prompt, and the rates are medians over repeats (robust on a noisy machine).
"""

from __future__ import annotations

import statistics

from engine.events import TurnFinished, TurnStats
from engine.models import LoadedModel
from engine.prompts import FILLER
from engine.sampling import SamplingSettings
from engine.session import ChatSession
from engine.speculative.drafters import DraftModel
from engine.speculative.loop import SpecStats, Speculation, make_speculation

PROMPTS = (
    ("repeat", "Repeat this text exactly, word for word:\n\n" + (FILLER * 2).strip()),
    ("question", "Why is the sky blue? Answer briefly."),
)


def _answer(
    loaded: LoadedModel, prompt: str, tokens: int, speculation: Speculation | None, compile: bool, raw: bool
) -> tuple[TurnStats, str, SpecStats]:
    settings = SamplingSettings(temperature=0.0, max_new_tokens=tokens)
    session = ChatSession(loaded, settings, compile=compile, raw=raw)
    session.speculation = speculation
    finished = [e for e in session.send(prompt) if isinstance(e, TurnFinished)][-1]
    return finished.stats, finished.text, speculation.stats if speculation else SpecStats()


def _decode_s(stats: TurnStats) -> float:
    """Seconds from the first token to the last (what decode_tok_s divides by)."""
    return (stats.generated_tokens - 1) / stats.decode_tok_s if stats.decode_tok_s else 0.0


def _summary(runs: list[list[tuple[TurnStats, SpecStats]]]) -> dict:
    """Median-run rate over the prompts of each repeat, and the speculation counts summed."""
    rates = []
    for run in runs:
        seconds = sum(_decode_s(s) for s, _ in run)
        rates.append(sum(s.generated_tokens - 1 for s, _ in run) / seconds if seconds else 0.0)
    spec = [c for run in runs for _, c in run]
    steps = [s.itl_p50_s for run in runs for s, _ in run if s.itl_p50_s > 0]
    paths = sorted({s.step_path for run in runs for s, _ in run if s.step_path})
    drafted, accepted = sum(c.drafted for c in spec), sum(c.accepted for c in spec)
    rounds, emitted = sum(c.rounds for c in spec), sum(c.emitted for c in spec)
    return {
        "tok_s": round(statistics.median(rates), 2),
        "acceptance": round(accepted / drafted, 3) if drafted else 0.0,
        "tokens_per_forward": round(emitted / rounds, 3) if rounds else 1.0,
        "draft_ms_per_round": round(1000 * sum(c.draft_s for c in spec) / rounds, 2) if rounds else 0.0,
        "verify_ms_per_round": round(1000 * sum(c.verify_s for c in spec) / rounds, 2) if rounds else 0.0,
        "step_ms": round(1000 * statistics.median(steps), 2) if steps else 0.0,
        "step_path": " and ".join(paths),
    }


def bench_speculative(
    loaded: LoadedModel, choice: str, k: int, tokens: int, repeats: int, compile: bool, raw: bool = False
) -> dict:
    """Plain against speculative decoding, interleaved, on PROMPTS; both sides greedy; `raw`: the
    prompts go as text, without the chat template (a base model's)."""
    speculation = make_speculation(choice, k, loaded, compile=compile)
    if isinstance(speculation.drafter, DraftModel):
        speculation.drafter.wait_compiled()  # its steady state, as the plain side's compiled step
    if compile:  # the whole compiled step from the first timed token (the sessions share it)
        compiled = ChatSession(loaded, SamplingSettings(temperature=0.0), compile=True).compiled
        if compiled is not None:
            compiled.wait_settled(900)
            compiled.want_verify()  # and the verify's own step, as an app's later answers have it
            compiled.wait_verify(900)
    plain_runs: list[list] = [[] for _ in range(repeats)]
    spec_runs: list[list] = [[] for _ in range(repeats)]
    per_prompt, identical = {}, True
    for name, prompt in PROMPTS:
        _answer(loaded, prompt, 4, None, compile, raw)  # warm-up: first calls allocate and pick kernels
        _answer(loaded, prompt, 4, speculation, compile, raw)
        for r in range(repeats):
            plain, plain_text, _ = _answer(loaded, prompt, tokens, None, compile, raw)
            spec, spec_text, counts = _answer(loaded, prompt, tokens, speculation, compile, raw)
            identical &= plain_text == spec_text
            plain_runs[r].append((plain, SpecStats()))
            spec_runs[r].append((spec, counts))
        per_prompt[name] = _both([[run[-1]] for run in plain_runs], [[run[-1]] for run in spec_runs])
    return {
        "drafter": speculation.drafter.name,
        "draft_tokens": k,
        **_both(plain_runs, spec_runs),
        "identical": identical,
        "prompts": per_prompt,
    }


def _both(plain_runs: list, spec_runs: list) -> dict:
    plain, spec = _summary(plain_runs), _summary(spec_runs)
    return {
        "tok_s": spec["tok_s"],
        "plain_tok_s": plain["tok_s"],
        "speedup": round(spec["tok_s"] / plain["tok_s"], 3) if plain["tok_s"] else 0.0,
        "plain_step_ms": plain["step_ms"],  # a plain step (median ITL): what a verify round about costs
        "plain_step_path": plain["step_path"],  # which step that was: "compiled" where compile is on
        **{
            key: spec[key]
            for key in ("acceptance", "tokens_per_forward", "draft_ms_per_round", "verify_ms_per_round")
        },
    }
