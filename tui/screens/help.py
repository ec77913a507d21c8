"""Help: the keys, and what each panel shows."""

from __future__ import annotations

from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Markdown, Static

from engine.instruments.explain import explain
from tui.instruments import help_table
from tui.widgets.explanation import explanation_content
from tui.widgets.token_stream import NEW, REUSED, legend

HELP = """\
# llmchat

| Key | Does |
|---|---|
| **Enter** | send the prompt |
| **Ctrl+J** | new line in the prompt (Shift+Enter / Alt+Enter where the terminal reports them) |
| **Esc** | stop the answer; the partial answer stays |
| **Ctrl+N** | new chat (the conversation stays saved; Ctrl+O finds it) |
| **Ctrl+R** | regenerate the last answer |
| **Ctrl+S** | settings: precision, theme and sampling (theme and sampling are remembered) |
| **Ctrl+O** | saved conversations: search, resume (Enter), rename (r), delete (d), export (m / j) |
| **Alt+↑** | select a message: ↑↓ move, ←→ step between its versions ‹ 2/3 ›, **e** edit it, Esc back |
| **Ctrl+T** | show or hide the panels (on a small terminal: switch between chat and panels) |
| **Ctrl+P** | command palette (every action above, plus themes) |
| **F1** | this help |
| **Ctrl+Q** | quit |

## The panels
- **Phase**: **PREFILL** pushes every new prompt token through the model at once
  (compute-bound; it ends with the first token, so its cost is **TTFT**). **DECODE** makes
  one token per step and must read every weight and the whole cache each time
  (memory-bound; its cost per token is **ITL**). The sparkline is the ITL of each token.
- **KV cache**: the keys and values of every token so far, in every layer. The gauge is
  tokens against the context window; bytes are summed from the real tensors; the formula
  shows where bytes per token come from. A follow-up turn only prefills its *new* tokens:
  the rest are **reused**. The answer's last token is never fed back (decoding stopped on
  it), so it is not cached: the next turn reuses prompt + answer − 1 and prefills it.
  The **K/V heads** table: the same context with one K/V head per query head (MHA), this
  model's count (◀, measured from the tensors) and one shared head (MQA), computed.
- **Top-k**: the most probable next tokens of the latest step after your sampling
  settings, the chosen one marked **▶**, and the entropy (how unsure the model was).
- **Tokens**: the prompt as the model sees it, each token marked as reused from the cache
  or prefilled now, then each generated token with its ID, coloured by its probability.
  The colours, as this theme draws them:
"""
INSTRUMENTS = f"""\
## Instruments (each also in Ctrl+P; **?** inside one opens its explanation, Esc closes it)
{help_table()}

Press **Esc** to close.
"""


def colours() -> Content:
    """The Tokens panel's colours, drawn in the theme in use (so no colour word can be wrong)."""
    return Content.assemble(
        "  ",
        (" reused ", REUSED),
        " from the cache   ",
        (" prefilled now ", NEW),
        " this turn   answer: ",
        legend(),
    )


class HelpScreen(ModalScreen[None]):
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll { width: 90; max-width: 100%; height: auto; max-height: 100%;
        border: thick $primary; background: $surface; }
    HelpScreen #colours { margin: 0 1 0 1; }
    HelpScreen #kv-heads { margin: 1 1 0 1; }
    """
    BINDINGS = [Binding("escape,f1,q", "dismiss", "Close")]

    def compose(self):
        with VerticalScroll():
            yield Markdown(HELP)
            yield Static(colours(), id="colours")
            yield Static(explanation_content(explain("kv_heads"), closes=False), id="kv-heads")
            yield Markdown(INSTRUMENTS)

    def on_mount(self) -> None:
        self.query_one(VerticalScroll).focus()  # so the arrow keys scroll
