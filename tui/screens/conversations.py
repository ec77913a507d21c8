"""Saved conversations: list, full-text search, resume, rename, delete and export.

Every store call runs on a worker thread with its own SQLite connection (never on the UI
thread, never on the inference thread); the workers only post messages, and the handlers
here change the widgets. The screen returns the id of the conversation to resume, or None.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Sequence

from rich.cells import cell_len
from rich.text import Text
from textual import on, work
from textual.binding import Binding
from textual.containers import Vertical
from textual.coordinate import Coordinate
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import DataTable, Footer, Input, Static
from textual.worker import get_current_worker

from engine.saved.store import ConversationSummary, Store, StoreError
from tui.fmt import visible_controls
from tui.screens.dialogs import ConfirmDialog, TextDialog

EXPORTS = {"md": "Markdown", "json": "JSON"}
LIST_COLUMNS = ("", "#", "Title", "Updated", "Turns", "Model")
"""The table's columns when listing; a search shows the match instead of the last three."""
SEARCH_COLUMNS = ("", "#", "Title", "Match")


@dataclass(frozen=True)
class Row:
    """One line of the list: a conversation, and in a search the text that matched."""

    id: int
    title: str
    updated: float | None = None
    turns: int | None = None
    model: str | None = None
    match_parts: tuple[tuple[str, bool], ...] = ()
    """What matched (search results only): the role and the snippet in pieces, each with whether it
    is a match, or 'title'."""

    @property
    def match(self) -> str:
        """What matched as plain text, the matches wrapped in [ and ]."""
        return "".join(f"[{text}]" if matched else text for text, matched in self.match_parts)


def summary_row(summary: ConversationSummary) -> Row:
    model = " ".join(part for part in (summary.model, summary.precision) if part)
    return Row(summary.id, summary.title, summary.updated, summary.turns, model or None)


def search_rows(store: Store, query: str) -> list[Row]:
    """Conversations whose messages match (best first, one row each), then those matching by title only."""
    rows: dict[int, Row] = {}
    for hit in store.search(query, limit=200):
        match = ((f"{hit.role}: ", False), *hit.parts)
        rows.setdefault(hit.conversation_id, Row(hit.conversation_id, hit.title, match_parts=match))
    words = query.lower().split()
    for summary in store.list_conversations():
        if summary.id not in rows and words and all(w in summary.title.lower() for w in words):
            rows[summary.id] = Row(summary.id, summary.title, match_parts=(("title", False),))
    return list(rows.values())


def cell(text: str) -> Text:
    """Saved text for a cell: one line, control characters shown (a Text, not markup: '[' stays text)."""
    return Text(visible_controls(text, one_line=True))


def highlight(parts: Sequence[tuple[str, bool]]) -> Text:
    """A search snippet on one line with its matches highlighted (a Rich Text: the table measures it)."""
    pieces = [(visible_controls(text, one_line=True), matched) for text, matched in parts]
    content = Text.assemble(*((text, "bold reverse") if matched else text for text, matched in pieces))
    content.rstrip()
    return content


def fitted(text: str | Text, width: int) -> Text:
    """One line of at most `width` cells, cut with an ellipsis (a Text, not a str: a title is not markup)."""
    line = Text(text) if isinstance(text, str) else text.copy()
    line.truncate(max(1, width), overflow="ellipsis")
    return line


def column_widths(width: int, searching: bool, rows: list[Row]) -> tuple[int, ...]:
    """The most each column may take, so that they fit `width` cells (two of padding per column,
    and room for a scrollbar). The table is given its columns' widths rather than left to measure
    them: one re-filled while its earlier rows were still to be measured kept its headers' widths,
    which cut every cell (seen on a slow machine: "Hi ␛]" for a title)."""
    ids = max((len(str(row.id)) for row in rows), default=1)
    if searching:  # the title gets up to a third; the match takes the rest
        title = max(12, min(max((len(row.title) for row in rows), default=5), width // 3))
        return 1, ids, title, max(1, width - title - 2 * 4 - 3 - ids)
    models = max(max((len(row.model or "?") for row in rows), default=5), len("Model"))
    dates, turns = len("2026-05-28 20:26"), len("Turns")
    title = max(12, width - (1 + ids + dates + turns + models) - 2 * 6 - 2)
    return 1, ids, title, dates, turns, models


def date(timestamp: float | None) -> str:
    return datetime.fromtimestamp(timestamp).strftime("%Y-%m-%d %H:%M") if timestamp is not None else ""


def _width(value: str | Text) -> int:
    return value.cell_len if isinstance(value, Text) else cell_len(value)


def export_path(directory: Path, conversation_id: int, extension: str) -> Path:
    """A new file name in `directory`; an existing file is never overwritten (a number is added)."""
    for n in range(1, 1000):
        suffix = "" if n == 1 else f"-{n}"
        path = directory / f"llmchat-conversation-{conversation_id}{suffix}.{extension}"
        if not path.exists():
            return path
    raise OSError(f"too many exports of conversation {conversation_id} in {directory}")


def export_text(store: Store, conversation_id: int, extension: str) -> str:
    if extension == "md":
        return store.export_markdown(conversation_id)
    return json.dumps(store.export_json(conversation_id), ensure_ascii=False, indent=2)


class ConversationTable(DataTable):
    """The list; Enter (select) resumes the highlighted conversation, and the footer says so."""

    BINDINGS = [Binding("enter", "select_cursor", "Resume")]

    class Resized(Message):
        """The table changed width: its columns are fitted again."""

    def on_resize(self) -> None:
        self.post_message(self.Resized())


class ConversationsScreen(ModalScreen[int | None]):
    DEFAULT_CSS = """
    ConversationsScreen { align: center middle; }
    ConversationsScreen > #box { width: 92%; height: 90%; border: thick $primary; background: $surface;
        padding: 0 1; }
    ConversationsScreen.-narrow > #box, ConversationsScreen.-short > #box { width: 100%; height: 100%;
        border: none; }
    ConversationsScreen #heading { text-style: bold; color: $text-primary; }
    ConversationsScreen #hint { color: $text-muted; }
    ConversationsScreen #search { margin: 1 0 0 0; }
    ConversationsScreen DataTable { height: 1fr; margin-top: 1; }
    ConversationsScreen #status { height: auto; margin-top: 1; }
    ConversationsScreen #status.-error { color: $text-error; }
    """
    BINDINGS = [
        Binding("escape", "close", "Close"),
        Binding("slash", "search", "Search"),
        Binding("r", "rename", "Rename"),
        Binding("d,delete", "delete", "Delete"),
        Binding("m", "export('md')", "Export .md"),
        Binding("j", "export('json')", "Export .json"),
    ]

    class Listed(Message):
        def __init__(self, query: str, rows: list[Row]) -> None:
            super().__init__()
            self.query = query
            self.rows = rows

    class Done(Message):
        """A change (rename, delete, export) finished: what to say, and whether it was an error."""

        def __init__(self, text: str, error: bool = False, refresh: bool = True) -> None:
            super().__init__()
            self.text = text
            self.error = error
            self.refresh_list = refresh

    def __init__(self, open_id: int | None = None, directory: Path | None = None) -> None:
        super().__init__()
        self.open_id = open_id
        """The conversation shown in the chat now (marked, and not deletable from here)."""
        self.directory = directory
        """Where exports go: the current directory unless given."""
        self.rows: dict[int, Row] = {}
        self._store: Store | None = None
        self._store_lock = threading.Lock()
        self._keep_status = False
        """The status line says what a change did; the refreshed list after it leaves that in place."""
        self._listed: ConversationsScreen.Listed | None = None
        """The rows shown last (fitted again when the screen changes size)."""

    def compose(self):
        with Vertical(id="box"):
            yield Static("Conversations", id="heading")
            yield Static(
                "Every finished turn is saved here. Exports (m, j) go into the current directory.",
                id="hint",
            )
            yield Input(
                placeholder="Search every message (full text; the last word may be a prefix)…",
                id="search",
                compact=True,
            )
            yield ConversationTable(cursor_type="row", zebra_stripes=True)
            yield Static("loading…", id="status", markup=False)
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self.query_one(DataTable).focus()
        self._fetch("")

    def on_unmount(self) -> None:
        with self._store_lock:
            if self._store is not None:
                self._store.close()
                self._store = None

    # -- the store, on worker threads -----------------------------------------------------
    def _open(self) -> Store:
        """This screen's own connection, opened on a worker thread (WAL mode: readers and writers
        share the file)."""
        with self._store_lock:
            if self._store is None:
                self._store = Store()
            return self._store

    @work(thread=True, exclusive=True, group="list")
    def _fetch(self, query: str) -> None:
        try:
            store = self._open()
            rows = (
                search_rows(store, query)
                if query.strip()
                else [summary_row(s) for s in store.list_conversations()]
            )
        except StoreError as e:
            self.post_message(self.Done(str(e), error=True, refresh=False))
            return
        if not get_current_worker().is_cancelled:
            self.post_message(self.Listed(query, rows))

    @work(thread=True, group="change")
    def _rename(self, conversation_id: int, title: str) -> None:
        try:
            self._open().rename(conversation_id, title)
        except StoreError as e:
            self.post_message(self.Done(str(e), error=True))
            return
        self.post_message(self.Done(f"Conversation {conversation_id} renamed to “{title.strip()}”."))

    @work(thread=True, group="change")
    def _delete(self, conversation_id: int) -> None:
        try:
            self._open().delete(conversation_id)
        except StoreError as e:
            self.post_message(self.Done(str(e), error=True))
            return
        deleted = f"Conversation {conversation_id} deleted, with every branch and its saved KV cache."
        self.post_message(self.Done(deleted))

    @work(thread=True, group="change")
    def _export(self, conversation_id: int, extension: str, directory: Path) -> None:
        try:
            text = export_text(self._open(), conversation_id, extension)
            path = export_path(directory, conversation_id, extension)
            with open(path, "x", encoding="utf-8") as f:  # "x": never overwrite a file
                f.write(text + "\n")
        except StoreError as e:
            self.post_message(self.Done(str(e), error=True, refresh=False))
            return
        except OSError as e:
            problem = f"could not export to {directory}: {e.strerror or e}"
            self.post_message(self.Done(problem, error=True, refresh=False))
            return
        exported = f"Exported conversation {conversation_id} ({EXPORTS[extension]}) to {path.resolve()}"
        self.post_message(self.Done(exported, refresh=False))

    # -- showing what the workers found ------------------------------------------------------
    def on_conversations_screen_listed(self, message: Listed) -> None:
        if message.query != self.query_one("#search", Input).value:
            return  # typed on since: a newer search is coming
        self._listed = message
        self._fill(message.query, message.rows)
        if self._keep_status:
            self._keep_status = False
        else:
            self._say(self._summary(message.query, len(message.rows)))

    def on_conversation_table_resized(self) -> None:
        """The columns were fitted to the old width (the dialog also changes size once it knows the
        terminal's): fit them again."""
        if self._listed is not None:
            self._fill(self._listed.query, self._listed.rows)

    def _fill(self, query: str, rows: list[Row]) -> None:
        """The table, its columns fitted to its width: titles and matches cut with an ellipsis."""
        table = self.query_one(DataTable)
        selected = self.selected()
        table.clear(columns=True)
        searching = bool(query.strip())
        budget = column_widths(table.size.width or self.size.width, searching, rows)
        cells = [self._cells(row, searching, budget) for row in rows]
        labels = SEARCH_COLUMNS if searching else LIST_COLUMNS
        for i, label in enumerate(labels):  # each as wide as its widest cell, within its budget
            table.add_column(label, width=max([cell_len(label), *(_width(row[i]) for row in cells)]))
        self.rows = {row.id: row for row in rows}
        for row, row_cells in zip(rows, cells):
            table.add_row(*row_cells, key=str(row.id))
        if selected in self.rows:
            table.move_cursor(row=table.get_row_index(str(selected)))

    def _cells(self, row: Row, searching: bool, widths: tuple[int, ...]) -> tuple:
        """A row's cells: the open mark, id and title, then the match or the date, turns and model."""
        mark = "●" if row.id == self.open_id else ""
        title = fitted(cell(row.title or "(untitled)"), widths[2])
        if searching:
            return (mark, str(row.id), title, fitted(highlight(row.match_parts), widths[3]))
        return (mark, str(row.id), title, date(row.updated), str(row.turns), cell(row.model or "?"))

    def _summary(self, query: str, count: int) -> str:
        if query.strip():
            found = "1 conversation matches" if count == 1 else f"{count} conversations match"
            return f"{found} “{query.strip()}”." if count else f"Nothing matches “{query.strip()}”."
        if not count:
            return "No saved conversations yet: every turn you finish in the chat is saved here."
        opened = " ● is the one open in the chat." if self.open_id in self.rows else ""
        return f"{count} conversation{'s' if count != 1 else ''}, newest first.{opened}"

    def on_conversations_screen_done(self, message: Done) -> None:
        self._say(message.text, message.error)
        if message.error:
            self.notify(message.text, severity="error", markup=False)
        elif not message.refresh_list:
            self.notify(message.text, title="Exported", timeout=8, markup=False)
        if message.refresh_list:
            self._keep_status = True
            self._fetch(self.query_one("#search", Input).value)

    def _say(self, text: str, error: bool = False) -> None:
        status = self.query_one("#status", Static)
        status.update(text)
        status.set_class(error, "-error")

    # -- what the user asked -----------------------------------------------------------------
    def selected(self) -> int | None:
        """The id of the highlighted conversation, if any."""
        table = self.query_one(DataTable)
        if not table.row_count:
            return None
        key = table.coordinate_to_cell_key(Coordinate(table.cursor_row, 0)).row_key.value
        return int(key) if key is not None else None

    def _chosen(self) -> Row | None:
        conversation_id = self.selected()
        if conversation_id is None:
            self._say("No conversation is selected.", error=True)
            return None
        return self.rows[conversation_id]

    @on(Input.Changed, "#search")
    def _search(self, event: Input.Changed) -> None:
        self._fetch(event.value)

    @on(Input.Submitted, "#search")
    def _to_results(self) -> None:
        self.query_one(DataTable).focus()

    @on(DataTable.RowSelected)
    def action_resume(self) -> None:
        row = self._chosen()
        if row is not None:
            self.dismiss(row.id)

    def action_search(self) -> None:
        self.query_one("#search", Input).focus()

    def action_close(self) -> None:
        search = self.query_one("#search", Input)
        if search.has_focus and search.value:
            search.value = ""
        elif search.has_focus:
            self.query_one(DataTable).focus()
        else:
            self.dismiss(None)

    def action_rename(self) -> None:
        row = self._chosen()
        if row is None:
            return

        shown = visible_controls(row.title, one_line=True)

        def renamed(title: str | None) -> None:
            if title is not None and title.strip() and title.strip() != shown:
                self._rename(row.id, title)

        self.app.push_screen(TextDialog(f"New title for conversation {row.id}:", shown), renamed)

    def action_delete(self) -> None:
        row = self._chosen()
        if row is None:
            return
        if row.id == self.open_id:
            self._say(
                f"Conversation {row.id} is open in the chat: "
                "start a new chat (Ctrl+N) first, then delete it.",
                error=True,
            )
            return
        title = visible_controls(row.title, one_line=True) or "(untitled)"
        question = (
            f"Delete conversation {row.id}, “{title}”, with every branch and its saved "
            "KV cache? This cannot be undone."
        )
        self.app.push_screen(ConfirmDialog(question, yes="Delete"), partial(self._delete_if, row.id))

    def _delete_if(self, conversation_id: int, yes: bool | None) -> None:
        """The answer to the confirmation: delete, or say that nothing was."""
        if yes:
            self._delete(conversation_id)
        else:
            self._say("Nothing was deleted.")

    def action_export(self, extension: str) -> None:
        row = self._chosen()
        if row is not None:
            self._export(row.id, extension, self.directory or Path.cwd())

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """While typing a search, the letter keys type; the row actions wait for the list."""
        if action in ("rename", "delete", "export") and isinstance(self.focused, Input):
            return None
        return True
