"""`llmchat conversations ...`: list, search, show, export, rename and delete saved conversations.

These work on the store alone; no model is loaded. REF is a
conversation id or `last`. $LLMCHAT_DATA_DIR moves the store. Saved text reaches the
terminal with its control characters made visible (an escape sequence in a title is shown,
not obeyed); `export` keeps the bytes exact when its output is a file or a pipe.
"""

from __future__ import annotations

import json
import sys
from datetime import datetime
from pathlib import Path
from typing import NoReturn, Optional

import typer

from engine.saved.store import ConversationSummary, SearchHit, Store, StoreError
from engine.utf8 import utf8_problem
from tui.cli.exits import FAILED, fail
from tui.fmt import visible_controls

conversations_app = typer.Typer(
    no_args_is_help=True,
    help="Saved conversations: list, show, export, rename, delete (REF is an id or 'last').",
)

RefArg = typer.Argument(..., help="A conversation id, or 'last' for the most recent one.")


def _fail(message: str) -> NoReturn:
    fail(message, FAILED)  # a conversation that cannot be read or written: the work failed


def open_store() -> Store:
    """The store, or a one-line error and exit 1."""
    try:
        return Store()
    except StoreError as e:
        _fail(str(e))


def _resolve(store: Store, ref: str) -> int:
    try:
        return store.resolve(ref)
    except StoreError as e:
        _fail(str(e))


def _check_text(text: str | None, what: str) -> None:
    """A one-line error and exit 1 for text the store cannot take (bytes from argv that are not UTF-8)."""
    problem = utf8_problem(text, what) if text is not None else None
    if problem:
        _fail(problem)


def _date(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp).strftime("%Y-%m-%d %H:%M")


def summary_line(row: ConversationSummary) -> str:
    model = visible_controls(f"{row.model or '?'} {row.precision or ''}".strip(), one_line=True)
    title = visible_controls(row.title, one_line=True) or "(untitled)"
    return f"{row.id:>5}  {_date(row.updated)}  {row.turns:>5}  {model:<24}  {title}"


def hit_line(hit: SearchHit) -> str:
    title = visible_controls(hit.title, one_line=True) or "(untitled)"
    snippet = visible_controls(hit.snippet, one_line=True).strip()
    return f"{hit.conversation_id:>5}  {hit.role:<9}  {title}: {snippet}"


@conversations_app.command("list")
def list_conversations(
    limit: int = typer.Option(50, "--limit", "-n", help="Show at most this many, newest first."),
    search: Optional[str] = typer.Option(None, "--search", "-s", help="Full-text search over every message."),
) -> None:
    """List saved conversations (id, last update, turns, model, title), or search them."""
    if limit < 1:
        _fail(f"--limit must be at least 1, got {limit}")
    _check_text(search, "--search")
    store = open_store()
    try:
        if search is not None:
            hits = store.search(search, limit)
            lines = [f"{'id':>5}  {'role':<9}  match"] + [hit_line(h) for h in hits]
        else:
            rows = store.list_conversations(limit)
            header = f"{'id':>5}  {'updated':<16}  {'turns':>5}  {'model':<24}  title"
            lines = [header] + [summary_line(r) for r in rows]
    except StoreError as e:
        _fail(str(e))
    if len(lines) == 1:
        typer.echo("no matches" if search is not None else "no saved conversations yet", err=True)
        return
    typer.echo("\n".join(lines))


@conversations_app.command()
def show(ref: str = RefArg) -> None:
    """Print a conversation's current branch as Markdown."""
    store = open_store()
    conversation_id = _resolve(store, ref)
    try:
        typer.echo(visible_controls(store.export_markdown(conversation_id)))
    except StoreError as e:
        _fail(str(e))


@conversations_app.command()
def export(
    ref: str = RefArg,
    format: str = typer.Option(
        "md", "--format", "-f", help="md (the current branch) or json (every branch)."
    ),
    output: Optional[Path] = typer.Option(
        None, "--output", "-o", help="Write to this file instead of stdout."
    ),
    force: bool = typer.Option(False, "--force", help="Overwrite the --output file if it exists."),
) -> None:
    """Export a conversation as Markdown or JSON (byte-exact, unless printed on a terminal)."""
    if format not in ("md", "json"):
        _fail(f"--format must be md or json, got {format!r}")
    store = open_store()
    conversation_id = _resolve(store, ref)
    try:
        if format == "md":
            text = store.export_markdown(conversation_id)
        else:
            text = json.dumps(store.export_json(conversation_id), ensure_ascii=False, indent=2)
    except StoreError as e:
        _fail(str(e))
    if output is None:  # not typer.echo: that drops escape sequences from a pipe, and an export is exact
        sys.stdout.write((visible_controls(text) if sys.stdout.isatty() else text) + "\n")
        return
    try:
        with open(output, "w" if force else "x", encoding="utf-8") as f:  # "x": never overwrite unasked
            f.write(text + "\n")
    except FileExistsError:
        _fail(f"{output} exists; pass --force to overwrite it")
    except OSError as e:
        _fail(f"cannot write {output}: {e.strerror or e}")
    typer.echo(f"llmchat: conversation {conversation_id} exported to {output}", err=True)


@conversations_app.command()
def rename(ref: str = RefArg, title: str = typer.Argument(..., help="The new title.")) -> None:
    """Give a conversation a new title."""
    _check_text(title, "the title")
    store = open_store()
    try:
        store.rename(_resolve(store, ref), title)
    except StoreError as e:
        _fail(str(e))


@conversations_app.command()
def delete(
    ref: str = RefArg,
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
) -> None:
    """Delete a conversation, every branch of it, and its saved KV cache."""
    store = open_store()
    conversation_id = _resolve(store, ref)
    title = visible_controls(store.conversation(conversation_id).title, one_line=True) or "(untitled)"
    if not yes and not typer.confirm(f"Delete conversation {conversation_id} ({title})?", default=False):
        typer.echo("llmchat: nothing deleted", err=True)
        raise typer.Exit(1)
    try:
        store.delete(conversation_id)
    except StoreError as e:
        _fail(str(e))
    typer.echo(f"llmchat: deleted conversation {conversation_id}", err=True)
