"""Fork from an alternative: crop the cache at the step, force the token, compute only what follows."""

import math

import pytest

from engine.events import Failed, Forked, PhaseChanged, StepPaused, TokenSampled, TurnFinished, to_json
from engine.sampling import SamplingSettings
from engine.session import ChatSession

QUESTION = "How does inference work?"
GREEDY = SamplingSettings(temperature=0.0, max_new_tokens=16)


def answered(loaded) -> ChatSession:
    session = ChatSession(loaded, GREEDY)
    list(session.send(QUESTION))
    assert len(session.trace) >= 6
    return session


def alternative(session: ChatSession, step: int) -> int:
    """The second most probable token at `step` (not a stop token)."""
    return next(c.id for c in session.trace.steps[step].top_k[1:] if c.id not in session.stop_ids)


def forced_fresh(loaded, step: int, token: int) -> ChatSession:
    """A fresh greedy generation that takes `token` at `step`, through step mode."""
    session = ChatSession(loaded, GREEDY)
    session.step_gate.pause()
    for event in session.send(QUESTION):
        if isinstance(event, StepPaused):
            if event.index == step:
                session.step_gate.take(token)
                session.step_gate.resume()
            else:
                session.step_gate.take()
    return session


def test_fork_at_temperature_0_equals_a_fresh_generation_with_that_token(tiny_loaded):
    session = answered(tiny_loaded)
    step, token = 3, alternative(session, 3)
    events = list(session.fork(step, token))
    fresh = forced_fresh(tiny_loaded, step, token)
    assert session.trace.ids == fresh.trace.ids
    assert session.trace.ids[step] == token
    assert session.messages[-1].content == fresh.messages[-1].content
    assert events[-1] == TurnFinished(events[-1].stats, fresh.messages[-1].content)


def test_fork_equals_a_fresh_prefill_of_the_forced_prefix(tiny_loaded):
    session = answered(tiny_loaded)
    step, token = 2, alternative(session, 2)
    prefix = [*session.trace.prompt_ids, *session.trace.ids[:step], token]
    list(session.fork(step, token))
    fresh = ChatSession(tiny_loaded, GREEDY)
    continuation = [e.id for e in fresh.run(prefix) if isinstance(e, TokenSampled)]
    tail = session.trace.ids[step + 1 :]  # the fork's answer counts its first `step` tokens too
    assert tail == continuation[: len(tail)]
    assert len(tail) == GREEDY.max_new_tokens - step - 1 or tail[-1] in session.stop_ids


def test_fork_reuses_the_cache_up_to_the_step_and_feeds_one_token(tiny_loaded):
    session = answered(tiny_loaded)
    prompt = len(session.trace.prompt_ids)
    step, token = 4, alternative(session, 4)
    events = list(session.fork(step, token))
    forked = next(e for e in events if isinstance(e, Forked))
    assert (forked.reused, forked.new) == (prompt + step, 1)
    assert PhaseChanged("prefill", 1, prompt + step) in events
    tokens = [e for e in events if isinstance(e, TokenSampled)]
    assert tokens[0].index == step and tokens[0].id == token and tokens[0].latency_s == 0.0
    assert [t.index for t in tokens] == list(range(step, step + len(tokens)))
    assert [t.position for t in tokens] == list(range(prompt + step, prompt + step + len(tokens)))
    assert events[-1].stats.prefilled_tokens == 1
    assert to_json(forked) == {
        "event": "forked",
        "step": step,
        "token_id": token,
        "reused": prompt + step,
        "new": 1,
        "original_text": forked.original_text,
        "start_text": forked.start_text,
    }
    assert session.messages[-1].content.startswith(forked.start_text)  # the new answer's beginning


def test_the_original_answer_is_kept_as_a_branch(tiny_loaded):
    session = answered(tiny_loaded)
    original = session.messages[-1]
    step, token = 3, alternative(session, 3)
    forced = next(c for c in original.trace.steps[step].top_k if c.id == token)
    events = list(session.fork(step, token))
    assert next(e for e in events if isinstance(e, Forked)).original_text == original.content
    trace = session.messages[-1].trace
    assert trace.parent is original.trace and trace.fork_step == step
    assert trace.steps[:step] == original.trace.steps[:step]
    taken = trace.steps[step]
    assert taken.rank == [c.id for c in taken.top_k].index(token) + 1
    assert taken.logprob == pytest.approx(math.log(forced.prob))
    assert len(session.messages) == 2 and session.messages[-1].role == "assistant"
    ids = [i for i in trace.ids if i not in session.stop_ids]
    assert session.messages[-1].content == session.tokenizer.decode(ids)


def test_a_fork_of_a_fork_and_of_an_earlier_answer(tiny_loaded):
    session = answered(tiny_loaded)
    list(session.send("unhappiness"))
    list(session.fork(2, alternative(session, 2)))
    list(session.fork(4, alternative(session, 4)))
    assert session.trace.parent.parent is not None
    first = session.messages[1]
    events = list(session.fork(1, alternative_of(first.trace, 1, session), answer=1))
    assert isinstance(events[-1], TurnFinished)
    assert [m.role for m in session.messages] == ["user", "assistant"]
    assert session.messages[1].trace.parent is first.trace


def alternative_of(trace, step, session):
    return next(c.id for c in trace.steps[step].top_k[1:] if c.id not in session.stop_ids)


def test_fork_refuses_what_it_cannot_do(tiny_loaded):
    session = answered(tiny_loaded)
    before = list(session.messages)
    offered = {c.id for c in session.trace.steps[0].top_k} | {session.trace.steps[0].id}
    outside = next(i for i in range(session.info.vocab_size) if i not in offered)
    for events in (session.fork(0, outside), session.fork(99, 5), session.fork(0, 5, answer=0)):
        assert isinstance(list(events)[-1], Failed)
    assert session.messages == before
    assert isinstance(list(ChatSession(tiny_loaded, GREEDY).fork(0, 5))[-1], Failed)
