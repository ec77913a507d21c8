"""Speculative decoding (engine/speculative/): same answers as plain decoding at temperature 0, the model's
own distribution above it, and the draft events."""

import pytest
import torch

from engine import models
from engine.events import CacheChanged, DraftRound, TokenSampled, to_json
from engine.sampling import Sampler, SamplingSettings
from engine.session import ChatSession
from engine.speculative.drafters import DraftModel, Drafts, PromptLookup, check_draft_tokens, lookup
from engine.speculative.loop import REST_ROUNDS, DraftLength, Speculation
from engine.speculative.verify import verify
from tests.tiny import build_tiny_model

TEXT = "the cat sat on the mat. the dog sat on the log. the cat saw the dog and the dog saw the cat."
PROMPTS = [f"Repeat this text exactly: {TEXT}", "hello there", f"Edit this: {TEXT} Make it shorter."]


@pytest.fixture(scope="module")
def other_tiny(tmp_path_factory):
    """A second tiny model with the same tokenizer and other weights: a draft that is often wrong."""
    return models.load(str(build_tiny_model(tmp_path_factory.mktemp("tiny-other"), seed=1)), "fp32", "cpu")


def answer(loaded, prompt, speculation=None, settings=None, fast=True):
    chat = ChatSession(loaded, settings or SamplingSettings(temperature=0, max_new_tokens=40), fast=fast)
    chat.speculation = speculation
    events = list(chat.send(prompt))
    tokens = [e for e in events if isinstance(e, TokenSampled)]
    return chat, events, tokens


def same_answer(plain, spec):
    """Token by token: ids, texts, positions and log-probabilities as plain decoding emits them."""
    (c0, _, t0), (c1, _, t1) = plain, spec
    assert [(t.index, t.id, t.text, t.position, t.rank) for t in t1] == [
        (t.index, t.id, t.text, t.position, t.rank) for t in t0
    ]
    assert [t.logprob for t in t1] == pytest.approx([t.logprob for t in t0], abs=1e-4)
    assert c1.messages[-1].content.encode() == c0.messages[-1].content.encode()
    assert c1.cache.ids == c0.cache.ids  # the rejected drafts left nothing behind


def test_lookup_proposes_what_followed_the_last_match():
    assert lookup([1, 2, 3, 4, 5, 1, 2], 2, 3) == [3, 4, 5]
    assert lookup([1, 2, 3, 1, 2, 9, 1, 2], 2, 2) == [9, 1]  # the most recent match
    assert lookup([1, 2, 3], 2, 3) == []
    drafts = PromptLookup().propose([7, 8, 9, 7, 8], 4, None)
    assert drafts.ids == [9, 7, 8] and drafts.probs is None


@pytest.mark.parametrize("k", [0, 9, -1, 2.0, True, "4"])
def test_draft_tokens_out_of_range_are_refused(k):
    with pytest.raises(ValueError, match="from 1 to 8"):
        check_draft_tokens(k)


@pytest.mark.parametrize("fast", [True, False], ids=["fused", "hf"])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_lookup_gives_the_plain_answer(tiny_loaded, prompt, fast):
    spec = Speculation(PromptLookup(), k=4)
    same_answer(answer(tiny_loaded, prompt, fast=fast), answer(tiny_loaded, prompt, spec, fast=fast))


@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_draft_model_gives_the_plain_answer(tiny_loaded, other_tiny, k):
    spec = Speculation(DraftModel(other_tiny, tiny_loaded.info.vocab_size, tiny_loaded.tokenizer), k=k)
    rejected = 0
    for prompt in PROMPTS:
        same_answer(answer(tiny_loaded, prompt), answer(tiny_loaded, prompt, spec))
        assert spec.stats.rounds > 0
        rejected += spec.stats.drafted - spec.stats.accepted  # the counts are per answer
    assert rejected > 0


def test_a_model_drafting_for_itself_is_always_right(tiny_loaded):
    spec = Speculation(DraftModel(tiny_loaded, tiny_loaded.info.vocab_size, tiny_loaded.tokenizer), k=4)
    settings = SamplingSettings(temperature=0, max_new_tokens=21)
    chat, events, tokens = answer(tiny_loaded, "hello there", spec, settings)
    if len(tokens) == 21:  # no early end of turn: 1 + 4 rounds of 5
        assert spec.stats.rounds == 4 and spec.stats.tokens_per_forward == 5.0
    assert spec.stats.acceptance == 1.0


def test_draft_events_come_before_their_tokens_and_carry_counts(tiny_loaded):
    spec = Speculation(PromptLookup(), k=4)
    chat, events, tokens = answer(tiny_loaded, PROMPTS[0], spec)
    rounds = [e for e in events if isinstance(e, DraftRound)]
    assert rounds and sum(r.accepted for r in rounds) == spec.stats.accepted
    for r in rounds:
        at = events.index(r)
        emitted = [e for e in events[at:] if isinstance(e, TokenSampled)][: r.accepted + 1]
        assert [t.id for t in emitted[: r.accepted]] == list(r.drafted[: r.accepted])
        assert emitted[0].index == r.index
        if r.accepted + 1 == len(emitted):
            assert emitted[-1].id == r.next
        assert isinstance(events[at + 1], CacheChanged)
    line = to_json(rounds[0])
    assert line["event"] == "draft" and set(line) == {
        "event",
        "index",
        "drafter",
        "drafted",
        "pieces",
        "accepted",
        "next",
        "draft_ms",
        "verify_ms",
    }


def test_max_new_tokens_and_context_stop_as_plain(tiny_loaded):
    for settings in (SamplingSettings(temperature=0, max_new_tokens=5), SamplingSettings(temperature=0)):
        plain = ChatSession(tiny_loaded, settings, context=80)
        spec = ChatSession(tiny_loaded, settings, context=80)
        spec.speculation = Speculation(PromptLookup(), k=8)
        a = [e for e in plain.send(TEXT) if isinstance(e, TokenSampled)]
        b = [e for e in spec.send(TEXT) if isinstance(e, TokenSampled)]
        assert [(t.id, t.position) for t in a] == [(t.id, t.position) for t in b]
        assert plain.cache.ids == spec.cache.ids


# -- temperature > 0: the emitted tokens follow the model's distribution --------------------------


def tiny_rows(loaded, ids):
    with torch.inference_mode():
        return loaded.model(input_ids=torch.tensor([ids])).logits[0].float()


def total_variation(counts: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - p).abs().sum())


@pytest.mark.parametrize("drafter", ["point", "model"])
def test_accept_reject_keeps_the_target_distribution(tiny_loaded, other_tiny, drafter):
    """Over many draws, the first emitted token is distributed as the target's p0 (a draft that is
    sometimes right), and the token after an accepted draft as the target's p1."""
    settings = SamplingSettings(temperature=1.0, top_k=12, seed=1234)
    sampler = Sampler(settings)
    ids = tiny_loaded.tokenizer("the cat sat on")["input_ids"]
    no_ids = torch.empty(0, dtype=torch.long)
    p0 = sampler.distribution(tiny_rows(tiny_loaded, ids)[-1], no_ids).exp()
    if drafter == "point":  # the target's most likely token, drafted with certainty (a lookup)
        d, q = int(torch.argmax(p0)), None
    else:
        q = sampler.distribution(tiny_rows(other_tiny, ids)[-1], no_ids).exp()
    logits_d = {}
    first, second = torch.zeros_like(p0), torch.zeros_like(p0)
    draws = 20_000
    for _ in range(draws):
        if q is not None:
            d = sampler.draw(q)
        if d not in logits_d:
            logits_d[d] = tiny_rows(tiny_loaded, ids + [d])[-2:]
        accepted, out = verify(
            sampler, logits_d[d], Drafts([d], None if q is None else [q]), lambda kept: no_ids
        )
        first[out[0].id] += 1
        if accepted and drafter == "point":
            second[out[1].id] += 1
    assert total_variation(first, p0) < 0.02
    if drafter == "point":
        p1 = sampler.distribution(logits_d[d][1], no_ids).exp()
        assert 1000 < second.sum() < draws - 100 and total_variation(second, p1) < 0.04


def test_sampled_answers_keep_their_length_and_positions(tiny_loaded, other_tiny):
    settings = SamplingSettings(temperature=0.9, top_p=0.9, repetition_penalty=1.2, seed=7, max_new_tokens=30)
    spec = Speculation(DraftModel(other_tiny, tiny_loaded.info.vocab_size, tiny_loaded.tokenizer), k=3)
    chat, events, tokens = answer(tiny_loaded, PROMPTS[0], spec, settings)
    assert [t.index for t in tokens] == list(range(len(tokens)))
    assert [t.position for t in tokens] == list(range(tokens[0].position, tokens[0].position + len(tokens)))
    assert chat.cache.ids[tokens[0].position :] == [t.id for t in tokens[:-1]]
    assert all(t.logprob <= 0 for t in tokens)


def test_a_draft_with_another_tokenizer_is_refused(tiny_loaded):
    class Other:
        def get_vocab(self):
            return {"a": 0}

    with pytest.raises(ValueError, match="tokenizer differs"):
        DraftModel(tiny_loaded, tiny_loaded.info.vocab_size, Other())


@pytest.mark.real_model
def test_smollm2_greedy_lookup_gives_the_plain_answer(smollm2):
    settings = SamplingSettings(temperature=0, max_new_tokens=32)
    spec = Speculation(PromptLookup(), k=4)
    prompts = [
        "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near the river bank.",
        "What is the capital of France?",
        "Fix the spelling: I recieved teh package yesterday and it was brokn.",
    ]
    accepted = 0
    for prompt in prompts:
        same_answer(answer(smollm2, prompt, settings=settings), answer(smollm2, prompt, spec, settings))
        accepted += spec.stats.accepted  # the counts are per answer
    assert accepted > 0


# -- the command line -----------------------------------------------------------------------------


def test_ask_speculative_lookup_prints_draft_events_and_every_token(tiny_model_dir):
    import json

    from typer.testing import CliRunner

    from tui.cli.main import app

    args = ["ask", PROMPTS[0], "-m", str(tiny_model_dir), "-t", "0", "-n", "24", "--no-save", "--json"]
    plain = CliRunner().invoke(app, args)
    spec = CliRunner().invoke(app, [*args, "--speculative", "lookup", "--draft-tokens", "3"])
    assert plain.exit_code == 0 and spec.exit_code == 0, spec.output
    lines = [json.loads(line) for line in spec.stdout.splitlines()]
    rounds = [e for e in lines if e["event"] == "draft"]
    assert rounds and all(len(e["drafted"]) <= 3 for e in rounds)

    def tokens(out):
        return [
            (e["index"], e["id"], e["text"])
            for e in map(json.loads, out.splitlines())
            if e["event"] == "token"
        ]

    assert tokens(spec.stdout) == tokens(plain.stdout)


@pytest.mark.parametrize("command", ["ask", "bench"])
def test_draft_tokens_out_of_range_is_one_line_before_loading(command):
    from typer.testing import CliRunner

    from tui.cli.main import app

    args = [command, "hello"] if command == "ask" else [command]
    result = CliRunner().invoke(app, [*args, "--speculative", "lookup", "--draft-tokens", "9"])
    assert result.exit_code != 0
    assert "--draft-tokens must be a whole number from 1 to 8, got 9" in result.output


def test_ask_with_a_draft_that_cannot_load_refuses(tiny_model_dir, tmp_path):
    from typer.testing import CliRunner

    from tui.cli.main import app

    missing = str(tmp_path / "no-such-model")
    args = ["ask", "hello", "-m", str(tiny_model_dir), "--no-save", "--speculative", missing]
    result = CliRunner().invoke(app, args)
    assert result.exit_code != 0 and f"--speculative {missing}" in result.output


# -- the setting, through the worker --------------------------------------------------------------


def test_the_worker_switches_speculation_and_keeps_the_last_good_setting(tiny_model_dir):
    from engine.events import Failed, Notice, TurnFinished
    from engine.worker import InferenceWorker
    from tests.test_resume import Recorder

    recorder = Recorder()
    worker = InferenceWorker(recorder, SamplingSettings(temperature=0, max_new_tokens=20))
    try:
        worker.load(str(tiny_model_dir), "fp32", "cpu")
        # The model drafting for itself always proposes, whatever a random model answers.
        worker.set_speculation(str(tiny_model_dir), 3)
        assert "drafts 3 tokens" in recorder.until(Notice)[-1].message
        worker.set_speculation("lookup", 9)
        assert "from 1 to 8" in recorder.until(Failed)[-1].message
        worker.send(TEXT)
        events = recorder.until(TurnFinished)
        assert any(isinstance(e, DraftRound) and len(e.drafted) <= 3 for e in events)
        worker.set_speculation(None)
        assert recorder.until(Notice)[-1].message == "speculative decoding off"
        worker.send("hello")
        assert not any(isinstance(e, DraftRound) for e in recorder.until(TurnFinished))
    finally:
        worker.shutdown()


def test_a_fork_decodes_speculatively_to_the_plain_fork(tiny_loaded):
    def forked(speculation):
        chat = ChatSession(tiny_loaded, SamplingSettings(temperature=0, max_new_tokens=30))
        chat.speculation = speculation
        list(chat.send(PROMPTS[0]))
        step = chat.trace.steps[3]
        other = next(c.id for c in step.top_k if c.id != step.id)
        events = list(chat.fork(3, other))
        return chat, [(e.index, e.id, e.position) for e in events if isinstance(e, TokenSampled)]

    plain, plain_tokens = forked(None)
    spec, spec_tokens = forked(Speculation(PromptLookup(), k=4))
    assert spec_tokens == plain_tokens
    assert spec.messages[-1].content == plain.messages[-1].content
    assert spec.cache.ids == plain.cache.ids


def test_a_drafter_whose_guesses_miss_backs_off_to_plain_steps():
    """Issue 34: lookup on an open question lost to plain decoding (a miss costs a verify of K+1).
    A round that keeps none starts a rest of REST_ROUNDS plain steps, then one token is tried; a
    retry that misses doubles the rest; K grows back while drafts are kept, and a round that keeps
    fewer than half halves it."""
    length = DraftLength(4)
    rounds = [(4, 0), *[(0, 0)] * 4, (1, 0), *[(0, 0)] * 8, (1, 1), (2, 2), (4, 4), (4, 1)]
    seen = []
    for drafted, kept in rounds:
        seen.append(length.next())
        length.after(drafted, kept)
    assert seen == [4, 0, 0, 0, 0, 1, *[0] * 8, 1, 2, 4, 4] and REST_ROUNDS == 4
    assert length.next() == 2 and length.rest == REST_ROUNDS
    length.after(2, 1)  # half kept: K stays
    assert length.next() == 2


class AlwaysWrong:
    """Drafts a token the model never picks here: every draft is rejected."""

    name = "wrong"

    def propose(self, context, k, sampler):
        return Drafts([0] * k, None)  # <|endoftext|>, never chosen greedily by the tiny model


def test_rejected_drafts_cost_few_verifies_and_change_no_token(tiny_loaded):
    plain = answer(tiny_loaded, "hello there")
    spec = Speculation(AlwaysWrong(), k=4)
    spoken = answer(tiny_loaded, "hello there", spec)
    same_answer(plain, spoken)
    stats = spec.stats
    assert stats.accepted == 0 and stats.rounds == len(spoken[2]) - 1  # one token a round
    # Without backing off: 4 drafts a round, 156 for 39 rounds; with it 4, then one token after
    # rests of 4, 8, 16 plain steps.
    assert stats.drafted <= 4 + 3
