"""The app side of speculative decoding: drafts marked in the token panel, the rounds in the phase panel."""

from engine.events import DraftRound, PhaseChanged, PromptTokens, TokenSampled
from tui.widgets.phase import PhasePanel
from tui.widgets.token_stream import ACCEPTED, REJECTED, TokenStream


def token(index: int, token_id: int, piece: str) -> TokenSampled:
    return TokenSampled(
        index=index,
        id=token_id,
        piece=piece,
        text=piece,
        logprob=-0.1,
        top_k=(),
        latency_s=0.01,
        position=10 + index,
    )


def test_kept_drafts_are_underlined_and_rejected_ones_struck_before_the_correction():
    stream = TokenStream()
    stream.prompt = PromptTokens((1, 2), ("a", "b"), 0)
    stream.add([token(0, 5, "x")], repaint=False)
    stream.add_round(DraftRound(1, "lookup", (6, 7, 8), ("p", "q", "r"), 1, 9, 0.001, 0.05))
    stream.add([token(1, 6, "p"), token(2, 9, "z")], repaint=False)
    spans = [(chip.plain.split()[0], {str(s.style) for s in chip.spans}) for chip in stream.chips]
    assert [piece[0] for piece, _ in spans] == ["x", "p", "q", "r", "z"]
    assert not any(ACCEPTED.strip() in style for style in spans[0][1])
    assert any(ACCEPTED.strip() in style for style in spans[1][1])
    assert all(REJECTED in spans[i][1] for i in (2, 3))
    assert not any(ACCEPTED.strip() in style for style in spans[4][1])
    assert (stream.drafted, stream.kept) == (3, 1)


def test_drafts_kept_past_the_end_of_the_answer_are_not_counted_as_shown():
    """It read "drafts kept 7/8" with 6 chips underlined and none struck: the round's kept EOS
    ended the answer, so the drafts after it were never shown."""
    stream = TokenStream()
    stream.prompt = PromptTokens((1, 2), ("a", "b"), 0)
    stream.add([token(0, 5, "x")], repaint=False)
    stream.add_round(DraftRound(1, "lookup", (6, 2, 8, 9), ("p", "<eos>", "r", "s"), 3, 7, 0.001, 0.05))
    stream.add([token(1, 6, "p"), token(2, 2, "<eos>")], repaint=False)  # the answer ends at the EOS
    underlined = [c for c in stream.chips if any(ACCEPTED.strip() in str(s.style) for s in c.spans)]
    assert stream.kept == len(underlined) == 2 and stream.drafted == 4


def test_phase_panel_shows_acceptance_and_tokens_per_forward():
    panel = PhasePanel()
    panel.set_phase(PhaseChanged("prefill", 4, 0))
    assert "memory-bound" not in panel._why().plain
    panel.add_round(DraftRound(1, "lookup", (6, 7, 8, 9), ("p",) * 4, 3, 1, 0.001, 0.05), repaint=False)
    panel.add_round(DraftRound(5, "lookup", (6, 7, 8, 9), ("p",) * 4, 1, 1, 0.001, 0.05), repaint=False)
    line = panel._why().plain
    assert line == "4/8 drafts kept · 3.0 tokens/pass · verify 50.0 ms"
    # The panel's 52 cells hold it with hundreds of drafts ("4.5 tokens/forw…" was cut).
    for i in range(100):
        panel.add_round(
            DraftRound(9 + i, "lookup", (6, 7, 8, 9), ("p",) * 4, 3, 1, 0.001, 0.104), repaint=False
        )
    assert panel._why().plain.startswith("304/408 drafts kept · 4.0 tokens/pass")
    assert len(panel._why().plain) <= 52


def test_config_json_sets_speculation_and_a_flag_wins(tmp_path):
    import json

    from tui.config import load_config
    from tui.options import options_from

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"speculative": "lookup", "draft_tokens": 3}))
    config, problem = load_config(path)
    assert problem is None
    options = options_from(config)
    assert (options.speculative, options.draft_tokens) == ("lookup", 3)
    options = options_from(config, speculative="smollm2-135m@w8", draft_tokens=6)
    assert (options.speculative, options.draft_tokens) == ("smollm2-135m@w8", 6)
    path.write_text(json.dumps({"speculative": 5, "draft_tokens": 12}))
    config, problem = load_config(path)
    assert (config.speculative, config.draft_tokens) == (None, 4)
    assert "draft_tokens must be a whole number from 1 to 8, got 12" in problem
    assert "speculative must be a string or null, got 5" in problem


def test_settings_switches_speculation_and_refuses_a_bad_k(tmp_path):
    import asyncio

    from tests.tui_fakes import FakeFactory, fake_app

    factory = FakeFactory()
    app = fake_app(factory, tmp_path, speculative="lookup", draft_tokens=3)
    asyncio.run(_switch(app, factory))


async def _switch(app, factory) -> None:
    from textual.widgets import Input, Select

    from tests.tui_screen import wait_for
    from tui.screens.settings import SettingsScreen

    async with app.run_test(size=(100, 40)) as pilot:
        await wait_for(pilot, lambda: app.turns.ready)
        assert ("set_speculation", "lookup", 3) in factory.engine.calls  # the flag, after the load
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: isinstance(app.screen, SettingsScreen))
        app.screen.query_one("#draft_tokens", Input).value = "9"
        app.screen.query_one("#speculative", Select).value = "off"
        await pilot.pause(0.2)
        assert app.screen.query_one("#draft_tokens-error").display  # K out of range: nothing changes
        assert app.speculation == ("lookup", 3)
        app.screen.query_one("#draft_tokens", Input).value = "5"
        app.screen.action_apply()
        await wait_for(pilot, lambda: app.speculation == (None, 5))
        assert factory.engine.calls[-1] == ("set_speculation", None, 5)
