"""Resume TTFT with and without the saved KV cache file, on a real multi-turn conversation.

    .venv/bin/python scripts/bench_resume.py [--model smollm2-135m] [--turns 6] [--repeats 3]

Builds a conversation of several greedy turns in a temporary store, saves its KV cache,
then resumes it again and again in fresh sessions, alternating: once ignoring the cache
file (the history is prefilled) and once loading it. "Resume to first token" is the
wall time from the resume call to the first token of the next answer, loading included.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

from engine import models
from engine.events import PromptTokens, TokenSampled, TurnFinished
from engine.sampling import SamplingSettings
from engine.saved.chat import SavedChat
from engine.saved.store import Store
from engine.session import ChatSession

QUESTIONS = (
    "Explain how a transformer language model generates text, step by step.",
    "What is the KV cache and why does it make decoding faster?",
    "How does the prefill phase differ from the decode phase?",
    "Why does memory bandwidth limit decoding speed on a GPU?",
    "What does quantizing weights to 8 bits change, and what does it cost?",
    "Summarize everything we discussed in three sentences.",
    "Which of these ideas matters most on a laptop CPU?",
    "Give one practical tip for making local chat faster.",
)
NEXT_QUESTION = "Thanks. One more: what is speculative decoding?"


def build_conversation(
    loaded: models.LoadedModel, store: Store, turns: int, sampling: SamplingSettings
) -> SavedChat:
    chat = SavedChat(ChatSession(loaded, sampling, system_prompt="You are a helpful assistant."), store)
    for i in range(turns):
        for _ in chat.send(QUESTIONS[i % len(QUESTIONS)]):
            pass
    return chat


def resume_to_first_token(loaded, store: Store, conversation_id: int, sampling, use_cache: bool) -> dict:
    """Resume in a fresh session and ask the next question; stop the answer at its first token."""
    chat = SavedChat(ChatSession(loaded, sampling), store)
    started = time.perf_counter()
    for _ in chat.resume(conversation_id, use_cache=use_cache):
        pass
    loaded_s = time.perf_counter() - started
    chat.store = None  # do not save the measured turns: every repeat resumes the same history
    result = {"load_s": loaded_s}
    for event in chat.send(NEXT_QUESTION):
        if isinstance(event, PromptTokens):
            result.update(prompt=len(event.ids), reused=event.reused)
        elif isinstance(event, TokenSampled) and event.index == 0:
            result["first_token_s"] = time.perf_counter() - started
            chat.session.cancel.set()
        elif isinstance(event, TurnFinished):
            result["ttft_s"] = event.stats.ttft_s
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=models.DEFAULT_MODEL)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--turns", type=int, default=6, help="Turns in the conversation before resuming.")
    parser.add_argument(
        "--answer-tokens", type=int, default=96, help="Greedy tokens per answer while building it."
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="Print one JSON object.")
    args = parser.parse_args()

    loaded = models.load(args.model, args.precision, args.device)
    sampling = SamplingSettings(temperature=0.0, max_new_tokens=args.answer_tokens)
    with tempfile.TemporaryDirectory() as directory, Store(directory) as store:
        chat = build_conversation(loaded, store, args.turns, sampling)
        started = time.perf_counter()
        chat.save_cache()
        save_s = time.perf_counter() - started
        file = store.cache_path(chat.conversation_id)
        runs = {"prefill": [], "cache_file": []}
        resume_to_first_token(loaded, store, chat.conversation_id, sampling, use_cache=False)  # warm-up
        for _ in range(args.repeats):
            for name, use_cache in (("prefill", False), ("cache_file", True)):
                runs[name].append(
                    resume_to_first_token(loaded, store, chat.conversation_id, sampling, use_cache)
                )
        report = summarize(loaded, args, len(chat.session.cache), file.stat().st_size, save_s, runs)
    print(json.dumps(report, indent=2) if args.json else render(report))


def summarize(loaded, args, history_tokens: int, file_bytes: int, save_s: float, runs: dict) -> dict:
    def median(name: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[name])

    report = {
        "model": loaded.info.name,
        "precision": loaded.info.precision,
        "device": loaded.info.device,
        "turns": args.turns,
        "history_tokens": history_tokens,
        "cache_file_mb": round(file_bytes / 1e6, 2),
        "cache_save_ms": round(save_s * 1000, 1),
        "repeats": args.repeats,
    }
    for name in runs:
        report[name] = {
            "prompt_tokens": runs[name][0]["prompt"],
            "reused_tokens": runs[name][0]["reused"],
            "load_ms": round(median(name, "load_s") * 1000, 1),
            "ttft_ms": round(median(name, "ttft_s") * 1000, 1),
            "resume_to_first_token_ms": round(median(name, "first_token_s") * 1000, 1),
        }
    report["speedup"] = round(
        report["prefill"]["resume_to_first_token_ms"] / report["cache_file"]["resume_to_first_token_ms"], 1
    )
    return report


def render(r: dict) -> str:
    lines = [
        f"{r['model']} · {r['precision']} · {r['device']} · "
        f"{r['turns']} turns, {r['history_tokens']} tokens of history",
        f"cache file: {r['cache_file_mb']} MB, saved in {r['cache_save_ms']} ms",
        f"{'resume':<22}{'prompt':>8}{'reused':>8}{'load ms':>10}{'TTFT ms':>10}{'to 1st token ms':>17}",
    ]
    for name, label in (("prefill", "history prefilled"), ("cache_file", "cache file loaded")):
        x = r[name]
        lines.append(
            f"{label:<22}{x['prompt_tokens']:>8}{x['reused_tokens']:>8}{x['load_ms']:>10}{x['ttft_ms']:>10}"
            f"{x['resume_to_first_token_ms']:>17}"
        )
    lines.append(
        f"resume to first token is {r['speedup']}x faster with the cache file (median of {r['repeats']})"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
