"""The TUI's small pure parts: config file, options, themes, settings parsing, formatting, turns, pacing."""

from __future__ import annotations

import json

import pytest
from textual.content import Content

from engine.sampling import SamplingSettings
from themes import load_themes, parse_theme
from tui import config, messages
from tui.config import Config, load_config, save_theme
from tui.fmt import entropy_bits, human_bytes, sparkline, visible_piece
from tui.options import options_from
from tui.screens.settings import check_field, field_text, parse_field
from tui.turns import TurnState
from tui.widgets.token_stream import pack_tail


def test_config_defaults_when_absent_and_problems_when_broken(tmp_path):
    path = tmp_path / "config.json"
    assert load_config(path) == (Config(), None)
    path.write_text("{not json")
    config_, problem = load_config(path)
    assert config_ == Config() and "ignoring" in problem
    path.write_text(json.dumps({"precision": "bf16", "sampling": {"temperature": 0.2}, "colour": "red"}))
    config_, problem = load_config(path)
    assert config_.precision == "bf16" and config_.sampling == {"temperature": 0.2}
    assert "unknown keys colour" in problem


def test_save_theme_keeps_the_rest_of_the_file(tmp_path):
    path = tmp_path / "deep" / "config.json"
    save_theme("llmchat-light", path)
    assert json.loads(path.read_text()) == {"theme": "llmchat-light"}
    path.write_text(json.dumps({"model": "x", "theme": "llmchat-light"}))
    save_theme("textual-dark", path)
    assert json.loads(path.read_text()) == {"model": "x", "theme": "textual-dark"}


def test_config_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(config.CONFIG_ENV, str(tmp_path))
    assert config.config_path() == tmp_path / "config.json"


def test_flags_win_over_the_config_file():
    file = Config(
        model="m", precision="bf16", theme="llmchat-light", sampling={"temperature": 0.2, "top_k": 5}
    )
    options = options_from(
        file,
        model=None,
        precision="fp16",
        device=None,
        system=None,
        context=None,
        theme=None,
        sampling={"temperature": 1.0},
    )
    assert (options.model, options.precision, options.device, options.theme) == (
        "m",
        "fp16",
        "auto",
        "llmchat-light",
    )
    assert options.sampling == {"temperature": 1.0, "top_k": 5}


def test_the_cli_default_model_is_the_engines():
    from engine.models import DEFAULT_MODEL

    assert config.DEFAULT_MODEL == DEFAULT_MODEL


def test_themes_come_from_the_tcss_files():
    themes = {t.name: t for t in load_themes()}
    assert {"llmchat-dark", "llmchat-light", "llmchat-high-contrast"} <= set(themes)
    assert themes["llmchat-light"].dark is False and themes["llmchat-high-contrast"].background == "#000000"
    theme = parse_theme("t", "/* c */ $primary: #123456; $dark: false; $text-alpha: 1.0; $chip: #ffffff;")
    assert (theme.primary, theme.dark, theme.text_alpha, theme.variables) == (
        "#123456",
        False,
        1.0,
        {"chip": "#ffffff"},
    )
    with pytest.raises(ValueError, match="primary"):
        parse_theme("t", "$background: #000000;")


@pytest.mark.parametrize(
    "name, text, problem",
    [
        ("temperature", "0.5", None),
        ("temperature", "9", "temperature must be in [0, 5], got 9"),
        ("temperature", "warm", "temperature must be a number, got 'warm'"),
        ("top_k", "2.5", "top_k must be a whole number, got '2.5'"),
        ("top_p", "0", "top_p must be in (0, 1], got 0"),
        ("seed", "", None),
        ("seed", "-1", "seed must be in [0, 9.22337e+18], got -1"),
        ("max_new_tokens", "0", "max_new_tokens must be in [1, 1e+06], got 0"),
    ],
)
def test_settings_fields_are_checked_with_the_engines_ranges(name, text, problem):
    assert check_field(SamplingSettings(), name, text) == problem


def test_settings_fields_round_trip():
    settings = SamplingSettings(temperature=0.25, top_k=40, seed=None)
    for name in SamplingSettings.names():
        assert parse_field(name, field_text(settings, name)) == getattr(settings, name)


def test_formatting():
    assert (
        visible_piece(" Paris\n") == "␣Paris↵"
        and visible_piece("\x0e") == "<0x0E>"
        and visible_piece("") == "∅"
    )
    assert human_bytes(512) == "512 B" and human_bytes(46_080 * 1024) == "45.0 MiB"
    assert entropy_bits([0.5, 0.5]) == 1.0 and entropy_bits([1.0, 0.0]) == 0.0
    assert sparkline([1, 2, 4], 5) == "  ▂▄█" and sparkline([], 3) == "   "


def test_pack_tail_keeps_the_newest_chips_that_fit():
    chips = [Content(f"w{i} ") for i in range(100)]  # 3 or 4 cells each
    rows, hidden = pack_tail(chips, width=20, lines=3)
    shown = [c.plain for row in rows for c in row]
    assert shown[-1] == "w99 " and hidden + len(shown) == 100 and len(rows) == 3
    assert all(sum(c.cell_length for c in row) <= 20 for row in rows)
    assert sum(c.cell_length for c in rows[0]) + len(f"…{hidden} earlier ") <= 20
    assert pack_tail(chips[:2], 20, 3) == ([chips[:2]], 0)


def test_turns_hand_the_engine_one_prompt_at_a_time():
    turns = TurnState()
    assert "waiting for the model to load" in turns.submit("a")
    assert turns.next_prompt() is None  # still loading
    turns.load_finished(have_model=True)
    assert turns.next_prompt() == "a" and turns.busy
    assert "queued" in turns.submit("b")
    assert turns.next_prompt() is None and not turns.start_other()
    turns.turn_over()
    assert turns.next_prompt() == "b"
    turns.turn_over()
    turns.load_started()
    turns.submit("c")
    turns.load_finished(have_model=False)
    assert turns.next_prompt() is None and turns.withdraw() == ["c"] and not turns.stoppable


def test_the_pacer_spaces_updates_by_what_drawing_costs(monkeypatch):
    cpu = [0.0]
    monkeypatch.setattr(messages.time, "thread_time", lambda: cpu[0])
    pacer = messages.Pacer(minimum=0.04, maximum=0.5, share=0.05)
    pacer.updated(10.0)
    assert pacer.delay(10.0) == pytest.approx(0.04)  # nothing spent yet: as often as allowed
    for step in range(1, 20):  # each update costs 10 ms of UI time: 10 ms / 5% = 0.2 s apart
        cpu[0] += 0.010
        pacer.updated(10.0 + step)
    assert pacer.delay(29.0) == pytest.approx(0.2, rel=0.01)
    assert pacer.delay(29.15) == pytest.approx(0.05, rel=0.05)
    for step in range(20, 40):  # dear updates never push the gap past the maximum
        cpu[0] += 1.0
        pacer.updated(10.0 + step)
    assert pacer.delay(49.0) == pytest.approx(0.5)


def test_the_inbox_keeps_tokens_in_order_and_only_the_newest_figure():
    from engine.events import CacheChanged, TokenSampled

    inbox = messages.Inbox()
    token = lambda i: TokenSampled(i, i, "x", "x", 0.0, (), 0.01, i)  # noqa: E731
    assert inbox.put(token(0)) is True  # the first item rings the doorbell
    assert inbox.put(CacheChanged(1, 10, 10, 100)) is False
    assert inbox.put(token(1)) is False
    assert inbox.put(CacheChanged(2, 20, 10, 100)) is False
    tokens, figures = inbox.take()
    assert [t.index for t in tokens] == [0, 1] and figures == [CacheChanged(2, 20, 10, 100)]
    assert inbox.take() == ([], []) and inbox.put(token(2)) is True
    assert messages.Doorbell().can_replace(messages.Doorbell())


def test_tokens_after_an_in_order_event_wait_until_it_is_shown():
    # A fork's first decoded token was taken by a paced update while the fork's "prefill" event,
    # posted before it, was still queued: no answer had begun, so the token was lost (CI, once).
    from engine.events import TokenSampled

    inbox = messages.Inbox()
    token = lambda i: TokenSampled(i, i, "x", "x", 0.0, (), 0.01, i)  # noqa: E731
    inbox.put(token(0))
    assert [t.index for t in inbox.before_ordered()[0]] == [0]  # shown before the event
    assert inbox.put(token(1)) is True  # rings; but the update must not take it yet
    assert inbox.take() == ([], [])
    assert [t.index for t in inbox.before_ordered()[0]] == [1]  # a second event: token 1 goes first
    inbox.put(token(2))
    assert inbox.ordered_shown() is False and inbox.take() == ([], [])  # one event still to be shown
    assert inbox.ordered_shown() is True  # now token 2 may be shown
    assert [t.index for t in inbox.take()[0]] == [2]


def test_chips_read_from_the_start_when_all_fit():
    from tui.widgets.token_stream import block

    chips = [Content(f"w{i} ") for i in range(8)]  # 3 cells each
    assert [row.plain for row in block(chips, width=20, lines=3)] == ["w0 w1 w2 w3 w4 w5 ", "w6 w7 "]
    assert block(chips, width=20, lines=1)[0].plain.startswith("…")


def test_a_stats_repaint_after_the_widgets_are_gone_paints_nothing():
    """The repaint timer can fire while the app closes, when its panels no longer exist."""
    from textual.css.query import NoMatches

    from tui.router import Router

    class ClosingApp:
        def part(self, kind):
            raise NoMatches(f"no {kind.__name__}")

    Router(ClosingApp()).repaint_stats()  # was: NameError for the uncaught NoMatches


def _matrix(size: int, sink: float, context: int | None = None):
    """A PrefillMatrix whose rows give position 0 `sink` and spread the rest evenly."""
    from array import array

    from engine.instruments.attention_matrix import PrefillMatrix

    rows = [array("f", [1.0])]
    for q in range(1, size):
        rest = (1 - sink) / q
        rows.append(array("f", [sink] + [rest] * q))
    uniform = sum(1 / (q + 1) for q in range(1, size)) / (size - 1)
    return PrefillMatrix(
        layer=3,
        head=1,
        kv_head=0,
        ids=tuple(range(size)),
        rows=tuple(rows),
        context=context or size,
        spans=(),
        prefilled=None,
        sink_shares=(0.0, sink, 0.0),
        uniform_share=uniform,
    )


def test_the_matrix_window_keeps_the_query_in_view():
    from tui.screens.attention_matrix import window_for

    w = window_for(100, query=99, top=0, rows=20, cols=60)
    assert (w.top, w.bottom, w.left, w.right) == (80, 100, 40, 100)  # the last row; keys end at its diagonal
    w = window_for(100, query=85, top=80, rows=20, cols=60)
    assert (w.top, w.left) == (80, 26)  # still in view: the rows do not move
    w = window_for(100, query=5, top=80, rows=20, cols=60)
    assert (w.top, w.left, w.right) == (5, 0, 60)  # up past the top: the rows follow, key 0 in view
    w = window_for(10, query=4, top=3, rows=20, cols=60)
    assert (w.top, w.rows, w.left, w.cols) == (0, 10, 0, 10)  # small: all of it


def test_the_grid_masks_the_upper_triangle_and_names_a_sink_only_when_it_is_one():
    from tui.screens.attention_matrix import grid_lines, ruler, sink_line, window_for, window_line

    sunk = _matrix(12, 0.6)
    window = window_for(12, 11, 0, 20, 60)
    lines = [line.plain for line in grid_lines(sunk, window, 11, [f"p{i}" for i in range(12)])]
    assert lines[0].endswith("0         10")  # the ruler
    assert lines[1].endswith("█" + "·" * 11) and lines[-1].startswith("▶") and "·" not in lines[-1]
    assert lines[5][16:] == "█▓▓▓▓" + "·" * 7  # row 4: 0.6 on the sink, 0.1 each after (5–20%), masked beyond
    assert "◆ attention sink at column 0: position 0 gets 60.0% of each row" in sink_line(sunk, window).plain
    even = _matrix(12, 1 / 12)
    assert sink_line(even, window).plain.startswith("no attention sink here (column 0): position 0 gets 8.3%")
    right = window_for(12, 11, 0, 20, 5)
    assert "position 0 (left of the window)" in sink_line(sunk, right).plain
    assert ruler(right).plain.endswith("→    10")  # keys 7–11: 10 at its column
    assert window_line(sunk, window) == "all 12 positions shown"
    cut = _matrix(12, 0.6, context=3000)
    assert "stops at position 11 of 3000" in window_line(cut, window) and "exact" in window_line(cut, window)


def test_a_turn_on_a_slower_step_says_which_beside_its_speed():
    from engine.events import TurnStats
    from tui.router import turn_summary

    def stats(step_path):
        return TurnStats(20, 0, 20, 8, 0.12, 0.05, 0.06, 150.0, 18.2, "eos", step_path=step_path)

    assert "18.2 tok/s (eager step) · done" in turn_summary(stats("fused"))
    assert "18.2 tok/s (HF forward) · done" in turn_summary(stats("reference"))
    assert "18.2 tok/s · done" in turn_summary(stats("compiled"))  # the usual step: nothing to say
    assert "18.2 tok/s · done" in turn_summary(stats(None))  # a server's answer
    one_token = TurnStats(20, 0, 20, 1, 0.12, 0.0, 0.0, 150.0, 0.0, "eos", step_path="fused")
    assert turn_summary(one_token) == "1 token · TTFT 120 ms · done"  # no gap timed: no rate (was 0.0 tok/s)


def test_the_phase_panel_says_a_server_decodes_instead_of_not_known_yet():
    """With --server the step line read "decode step: not known yet" all session."""
    from tui.widgets.phase import step_line

    assert step_line(None, None, "llama.cpp").plain == "decode step on the server (llama.cpp): not reported"
    assert step_line(None).plain == "decode step: not known yet"  # the local engine, before a load


def test_f8_does_not_say_its_tokens_begin_as_a_step_mode_answer_did():
    """After a step-mode answer F8 said "they begin as the chat's answer did" where they did not."""
    from tui.screens.precision import intro

    greedy = SamplingSettings(temperature=0)
    assert intro("fp32", greedy).endswith("so they begin as the chat's answer did.")
    stepped = intro("fp32", greedy, "step mode")
    assert "begin as the chat's answer did" not in stepped
    assert stepped.endswith("chosen token by token in step mode, so these tokens can differ from it.")
