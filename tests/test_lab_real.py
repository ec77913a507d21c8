"""The serving lab on the real SmolLM2-135M-Instruct at fp32: batched greedy equals served alone."""

import pytest

from engine.events import PromptTokens, TokenSampled
from engine.lab.run import Lab, LabConfig
from engine.lab.scheduler import Policy, Scheduler
from engine.lab.workload import RequestSpec
from engine.sampling import SamplingSettings
from engine.session import ChatSession

pytestmark = pytest.mark.real_model


def test_batched_answers_equal_each_served_alone_and_the_chat(smollm2):
    # Three users (a short question, the Korean one, a long one) at once: prefill chunks beside decode.
    lab = Lab(smollm2, LabConfig(requests=3, max_batch=3, max_new=12, budget_mib=16, step_tokens=32, seed=1))
    assert len({len(s.prompt) for s in lab.specs}) == 3
    together = {r.spec.id: r.out for r in lab.run_policy("continuous", None, None).requests}
    for spec in lab.specs:
        (alone,) = Scheduler(Policy.named("sequential", 1), [spec], lab.forward, lab.eos).run()
        assert together[spec.id] == alone.out, spec.question
    # the lab served alone answers the chat's own prompt as the chat's greedy decode does
    session = ChatSession(smollm2, SamplingSettings(temperature=0, max_new_tokens=12))
    events = list(session.send(lab.specs[0].question))
    prompt = next(e.ids for e in events if isinstance(e, PromptTokens))
    chat = [e.id for e in events if isinstance(e, TokenSampled)]
    spec = RequestSpec(99, "the chat's prompt", tuple(prompt), 0.0, 12)
    (alone,) = Scheduler(Policy.named("sequential", 1), [spec], lab.forward, lab.eos).run()
    assert alone.out == chat[: len(alone.out)] and len(alone.out) >= min(len(chat), 12)
    lab.release()
