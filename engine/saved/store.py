"""Saved conversations: SQLite in WAL mode, messages as a tree, full-text search.

Every message is committed in its own transaction before the call returns, so a crash or
`kill -9` loses nothing that was shown as finished. Messages form a tree (each has a
parent), so an edit or a regeneration adds a sibling and the old branch stays; the
conversation's `leaf_id` says which branch is current. A file this version cannot read (a
corrupt one, one written by a newer llmchat, a foreign database) raises StoreError and is
never modified: callers show the one-line message and carry on without a store.

A file that opens but is damaged (SQLite's quick check fails on opening, or any statement
later reports corruption) is never written again: `damaged` says why, every write raises
StoreError, and reading goes on as far as the file allows. A new conversation and its first
message are one transaction, so a write refused halfway leaves nothing behind.

Two writers on one conversation (two `llmchat ask --conversation last`, the app and a
command) are serialised against its head: a writer passes the leaf it last saw
(`expected_leaf`), and a write to a conversation whose leaf moved since fails whole with
ConversationChanged. A turn holds its conversation from the question to the answer
(`turn()`, an OS file lock the kernel lets go of if the process dies), so nobody puts a
question after one still being answered.

Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import sqlite3
import threading
import time
import unicodedata
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, ContextManager, Iterator

import platformdirs

from engine.errors import one_line

try:
    import fcntl
except ImportError:  # Windows: turns are not held (see Store.turn)
    fcntl = None

DATA_DIR_ENV = "LLMCHAT_DATA_DIR"
"""Environment variable that moves the data directory (tests point it at a tmp dir)."""

DB_NAME = "conversations.db"
SCHEMA_VERSION = 2
"""Stored in PRAGMA user_version; a file with a higher number is refused, never rewritten."""

EXPORT_FORMAT = "llmchat-conversation"
TITLE_CHARS = 60
"""A title made from the first message is cut to this many characters."""
TITLE_MAX = 200
"""The longest title a rename may give (a title is shown on one line of a list)."""

_SCHEMA_V1 = """
CREATE TABLE conversations (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    title         TEXT NOT NULL DEFAULT '',
    created       REAL NOT NULL,
    updated       REAL NOT NULL,
    model         TEXT,
    precision     TEXT,
    system_prompt TEXT,
    leaf_id       INTEGER
);
CREATE TABLE messages (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    parent_id       INTEGER REFERENCES messages(id) ON DELETE CASCADE,
    role            TEXT NOT NULL CHECK (role IN ('user', 'assistant')),
    content         TEXT NOT NULL,
    created         REAL NOT NULL,
    model           TEXT,
    precision       TEXT,
    sampling        TEXT,
    stop            TEXT,
    prompt_tokens   INTEGER,
    reused_tokens   INTEGER,
    tokens          INTEGER,
    ttft_s          REAL,
    itl_p50_s       REAL,
    itl_p90_s       REAL,
    prefill_tok_s   REAL,
    decode_tok_s    REAL
);
CREATE INDEX messages_by_conversation ON messages(conversation_id);
CREATE INDEX messages_by_parent ON messages(parent_id);
CREATE VIRTUAL TABLE messages_fts USING fts5(content, content='messages', content_rowid='id');
CREATE TRIGGER messages_fts_insert AFTER INSERT ON messages BEGIN
    INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content);
END;
CREATE TRIGGER messages_fts_delete AFTER DELETE ON messages BEGIN
    INSERT INTO messages_fts(messages_fts, rowid, content) VALUES ('delete', old.id, old.content);
END;
CREATE TRIGGER messages_fts_update AFTER UPDATE OF content ON messages BEGIN
    INSERT INTO messages_fts(messages_fts, rowid, content) VALUES ('delete', old.id, old.content);
    INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content);
END;
"""

_SCHEMA_V2 = """
ALTER TABLE messages ADD COLUMN token_ids TEXT;
ALTER TABLE messages ADD COLUMN step_path TEXT;
ALTER TABLE messages ADD COLUMN speculative TEXT;
ALTER TABLE messages ADD COLUMN kv_cache TEXT;
ALTER TABLE messages ADD COLUMN fork_step INTEGER;
"""

MIGRATIONS = (_SCHEMA_V1, _SCHEMA_V2)
"""MIGRATIONS[n] takes a file from user_version n to n + 1."""

_RECORD_FIELDS = (
    "model", "precision", "sampling", "stop", "prompt_tokens", "reused_tokens", "tokens",
    "ttft_s", "itl_p50_s", "itl_p90_s", "prefill_tok_s", "decode_tok_s", "token_ids",
    "step_path", "speculative", "kv_cache", "fork_step",
)  # fmt: skip


class StoreError(RuntimeError):
    """The store cannot be used; the message is one line for the user."""


class ConversationChanged(StoreError):
    """Another writer moved the conversation's leaf since this one read it; nothing was written."""


class ConversationBusy(StoreError):
    """Another turn (in this process or another) holds the conversation; nothing was written."""


@dataclass(frozen=True)
class AnswerRecord:
    """How an answer was made (enough to reproduce it) and how fast it came."""

    model: str
    precision: str
    sampling: dict[str, Any]
    """The SamplingSettings fields, seed included."""
    stop: str
    prompt_tokens: int | None
    reused_tokens: int | None
    """None where a remote server did not report it."""
    tokens: int
    """Generated tokens."""
    ttft_s: float
    itl_p50_s: float
    itl_p90_s: float
    prefill_tok_s: float
    decode_tok_s: float
    token_ids: tuple[int, ...] | None = None
    """The ids the answer was sampled as, less the stop token: a follow-up's prompt holds them as
    they are (its text may tokenize otherwise), so a resumed cache is reused to its end. None in a
    file of format 1, or from a server."""
    step_path: str | None = None
    """What decoded it: 'compiled', 'fused', 'reference', or 'step mode' (each token chosen)."""
    speculative: str | None = None
    """Who drafted and K ('lookup, K 4') for a speculative answer."""
    kv_cache: str | None = None
    """The KV cache precision it was decoded with (fp32, bf16, fp16, int8)."""
    fork_step: int | None = None
    """For a forked answer: the step where it took another token than the answer it branched from."""


@dataclass(frozen=True)
class StoredMessage:
    id: int
    conversation_id: int
    parent_id: int | None
    role: str
    content: str
    created: float
    record: AnswerRecord | None
    """Set for answers; None for user messages."""


@dataclass(frozen=True)
class Conversation:
    id: int
    title: str
    created: float
    updated: float
    model: str | None
    """The model of the latest answer (or the one it was started with)."""
    precision: str | None
    system_prompt: str | None
    leaf_id: int | None
    """The last message of the current branch."""


@dataclass(frozen=True)
class ConversationSummary:
    """One row of the conversation list."""

    id: int
    title: str
    updated: float
    turns: int
    """User messages on the current branch."""
    model: str | None
    precision: str | None


@dataclass(frozen=True)
class SearchHit:
    conversation_id: int
    title: str
    message_id: int
    role: str
    parts: tuple[tuple[str, bool], ...]
    """The matching text in pieces, each with whether it is a match (brackets in a message stay text)."""

    @property
    def snippet(self) -> str:
        """The matching text with each match wrapped in [ and ], for plain output."""
        return "".join(f"[{text}]" if matched else text for text, matched in self.parts)


def data_dir(override: str | os.PathLike | None = None) -> Path:
    """Where the store lives: the argument, else $LLMCHAT_DATA_DIR, else the user data dir."""
    if override is not None:
        return Path(override).expanduser()
    if os.environ.get(DATA_DIR_ENV):
        return Path(os.environ[DATA_DIR_ENV]).expanduser()
    return Path(platformdirs.user_data_dir("llmchat"))


_SQLITE_CORRUPT, _SQLITE_FULL, _SQLITE_NOTADB = 11, 13, 26
_DAMAGE_WORDS = ("malformed", "not a database", "corrupt", "vtable constructor failed", "invalid fts5")


def _is_damage(error: sqlite3.Error) -> bool:
    """Does the error say the file itself is damaged (rather than busy, full or unwritable)?"""
    code = getattr(error, "sqlite_errorcode", None)
    if code is not None and code & 0xFF in (_SQLITE_CORRUPT, _SQLITE_NOTADB):
        return True
    return any(word in str(error).lower() for word in _DAMAGE_WORDS)


def _damaged(path: Path, reason: str) -> str:
    return (
        f"conversation store {path} is damaged ({reason}); it was left untouched and nothing more "
        "is saved to it: move it away to start afresh"
    )


def _explain(error: sqlite3.Error, path: Path) -> StoreError:
    """A one-line StoreError that says what is wrong and that nothing was changed."""
    text = one_line(error)
    if _is_damage(error) and not _unreadable(text):
        return StoreError(_damaged(path, text))
    return StoreError(f"conversation store {path} {_reason(error, text)}")


def _unreadable(text: str) -> bool:
    """Does SQLite's message say the file is no database at all (rather than a damaged one)?"""
    lowered = text.lower()
    return "not a database" in lowered or "malformed" in lowered


def _reason(error: sqlite3.Error, text: str) -> str:
    """What went wrong, for "conversation store PATH ..." (`text`: the error on one line)."""
    lowered = text.lower()
    code = getattr(error, "sqlite_errorcode", None)
    if _unreadable(text):
        return (
            "is not a readable llmchat database (corrupt?); it was left untouched, "
            "move it away to start afresh"
        )
    if (code is not None and code & 0xFF == _SQLITE_FULL) or "disk is full" in lowered:
        return "cannot be written: the disk is full (what was saved before is intact); free some space"
    if "locked" in lowered or "busy" in lowered:
        return "is locked by another process; try again in a moment"
    if "readonly" in lowered or "unable to open" in lowered:
        return f"cannot be opened for writing ({text}); check the directory's permissions"
    return f"failed: {text}"


def _title_from(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= TITLE_CHARS else line[: TITLE_CHARS - 1].rstrip() + "…"


def check_title(title: str) -> str:
    """`title` without surrounding spaces, or a StoreError if it is not one line of at most TITLE_MAX."""
    title = title.strip()
    if any(unicodedata.category(ch) in ("Cc", "Zl", "Zp") for ch in title):
        raise StoreError(
            "a title must be one line of text, without control characters (newline, tab, escape)"
        )
    if len(title) > TITLE_MAX:
        raise StoreError(f"a title must be at most {TITLE_MAX} characters; this one has {len(title)}")
    return title


def snippet_parts(snippet: str, start: str, end: str) -> tuple[tuple[str, bool], ...]:
    """Split an FTS snippet whose matches sit between `start` and `end` into (text, is_match) pieces."""
    first, *marked = snippet.split(start)
    parts = [(first, False)]
    for piece in marked:
        match, _, rest = piece.partition(end)
        parts += [(match, True), (rest, False)]
    return tuple(part for part in parts if part[0])


def fts_query(text: str) -> str:
    """User text as a safe FTS5 query: every word must appear; the last may be a prefix."""
    words = [w.replace('"', '""') for w in text.split()]
    if not words:
        return ""
    terms = [f'"{w}"' for w in words]
    terms[-1] += "*"
    return " ".join(terms)


class Store:
    """One SQLite file of conversations; safe to share between threads and processes."""

    def __init__(self, directory: str | os.PathLike | None = None, timeout_s: float = 5.0):
        self.directory = data_dir(directory)
        self.db_path = self.directory / DB_NAME
        self.damaged: str | None = None
        """Why the file cannot be trusted, once that is known; from then on every write is refused."""
        self._lock = threading.RLock()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(
                f"cannot create the data directory {self.directory}: {e.strerror or e}"
            ) from None
        try:
            self._db = sqlite3.connect(
                self.db_path, timeout=timeout_s, isolation_level=None, check_same_thread=False
            )
        except sqlite3.Error as e:
            raise _explain(e, self.db_path) from None
        try:
            self._open(timeout_s)
        except sqlite3.Error as e:
            self._db.close()
            raise _explain(e, self.db_path) from None
        except StoreError:
            self._db.close()
            raise

    def _open(self, timeout_s: float) -> None:
        """Check the file before changing anything in it, then migrate it to our schema."""
        self._db.row_factory = sqlite3.Row
        self._db.execute(f"PRAGMA busy_timeout = {int(timeout_s * 1000)}")
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        self._check_ours(version)
        problem = self._db.execute("PRAGMA quick_check(1)").fetchone()[0]
        if problem != "ok":
            found = [line for line in problem.splitlines() if not line.startswith("*** in database")]
            self._refuse_writes(_damaged(self.db_path, f"quick check: {(found or [problem])[0]}"))
            return  # not even the journal mode: not one byte of the file changes
        self._db.execute("PRAGMA journal_mode = WAL")
        self._db.execute("PRAGMA synchronous = FULL")
        self._db.execute("PRAGMA foreign_keys = ON")
        if version < SCHEMA_VERSION:
            self._migrate()

    def _check_ours(self, version: int) -> None:
        """Raise StoreError, changing nothing, unless this llmchat or an older one wrote the file
        (format `version`) or it is empty."""
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"conversation store {self.db_path} was written by a newer llmchat "
                f"(format {version}, this one reads up to {SCHEMA_VERSION}); "
                f"it was left untouched: upgrade llmchat or set {DATA_DIR_ENV}"
            )
        if version == 0 and self._db.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]:
            raise StoreError(f"{self.db_path} is a database llmchat did not write; it was left untouched")

    def _migrate(self) -> None:
        with self._write() as db:
            # Read again inside the write lock: another process may have migrated meanwhile.
            version = db.execute("PRAGMA user_version").fetchone()[0]
            for script in MIGRATIONS[version:]:
                for statement in _statements(script):
                    db.execute(statement)
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def _refuse_writes(self, reason: str) -> None:
        """From now on nothing is written to the file: our writes raise, and SQLite's own guard is on."""
        self.damaged = self.damaged or reason
        with contextlib.suppress(sqlite3.Error):
            self._db.execute("PRAGMA query_only = ON")

    def _failed(self, error: sqlite3.Error) -> StoreError:
        """The StoreError for a failed statement; damage found by it also stops every later write."""
        explained = _explain(error, self.db_path)
        if _is_damage(error):
            self._refuse_writes(str(explained))
        return explained

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- transactions ---------------------------------------------------------------
    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction, committed (durably) before the block's caller goes on."""
        with self._lock:
            if self.damaged:
                raise StoreError(self.damaged)
            try:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    yield self._db
                    self._db.execute("COMMIT")
                except BaseException:
                    # SQLite may have rolled back already (a full disk does): keep the first error.
                    if self._db.in_transaction:
                        with contextlib.suppress(sqlite3.Error):
                            self._db.execute("ROLLBACK")
                    raise
            except sqlite3.Error as e:
                raise self._failed(e) from None

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            try:
                yield self._db
            except sqlite3.Error as e:
                raise self._failed(e) from None

    # -- conversations ----------------------------------------------------------------
    def create_conversation(
        self,
        model: str | None = None,
        precision: str | None = None,
        system_prompt: str | None = None,
        title: str = "",
    ) -> Conversation:
        """A new, empty conversation (its title comes from the first user message if not given)."""
        title = check_title(title)
        with self._write() as db:
            conversation_id = _insert_conversation(db, model, precision, system_prompt, title)
        return self.conversation(conversation_id)

    def start_conversation(
        self,
        role: str,
        content: str,
        model: str | None = None,
        precision: str | None = None,
        system_prompt: str | None = None,
        record: AnswerRecord | None = None,
    ) -> StoredMessage:
        """A new conversation with its first message, in one transaction: a failure leaves neither."""
        _check_role(role)
        with self._write() as db:
            conversation_id = _insert_conversation(db, model, precision, system_prompt, "")
            message_id = self._append(db, conversation_id, role, content, None, record)
        return self.message(message_id)

    def conversation(self, conversation_id: int) -> Conversation:
        with self._read() as db:
            row = db.execute("SELECT * FROM conversations WHERE id = ?", (conversation_id,)).fetchone()
        if row is None:
            raise StoreError(f"no conversation {conversation_id}")
        return Conversation(**dict(row))

    def resolve(self, ref: str | int) -> int:
        """A conversation id from `ref`: an id, or 'last' for the most recently updated one."""
        if str(ref) == "last":
            with self._read() as db:
                row = db.execute(
                    "SELECT id FROM conversations ORDER BY updated DESC, id DESC LIMIT 1"
                ).fetchone()
            if row is None:
                raise StoreError("there are no saved conversations yet")
            return row["id"]
        try:
            conversation_id = int(ref)
        except ValueError:
            raise StoreError(f"{ref!r} is not a conversation id; use a number or 'last'") from None
        if not 0 < conversation_id < 2**63:  # SQLite's ids; a bigger number cannot even be looked up
            raise StoreError(f"no conversation {conversation_id}")
        return self.conversation(conversation_id).id

    def list_conversations(self, limit: int | None = None) -> list[ConversationSummary]:
        """Most recently updated first, with the number of turns on each current branch."""
        with self._read() as db:
            rows = db.execute(
                _PATH_CTE
                + """
                SELECT c.id, c.title, c.updated, c.model, c.precision, count(p.id) AS turns
                FROM conversations c LEFT JOIN path p ON p.conversation_id = c.id AND p.role = 'user'
                GROUP BY c.id ORDER BY c.updated DESC, c.id DESC LIMIT ?""",
                (-1 if limit is None else limit,),
            ).fetchall()
        return [ConversationSummary(**dict(row)) for row in rows]

    def rename(self, conversation_id: int, title: str) -> None:
        """A new title: one line of at most TITLE_MAX characters (StoreError says what is wrong)."""
        title = check_title(title)
        with self._write() as db:
            changed = db.execute(
                "UPDATE conversations SET title = ?, updated = ? WHERE id = ?",
                (title, time.time(), conversation_id),
            ).rowcount
        if not changed:
            raise StoreError(f"no conversation {conversation_id}")

    def delete(self, conversation_id: int) -> None:
        """Delete a conversation, all its branches, and its saved KV cache file."""
        with self._write() as db:
            changed = db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,)).rowcount
        if not changed:
            raise StoreError(f"no conversation {conversation_id}")
        with suppress(OSError):  # ids are never reused, so its lock file is of no more use
            self._lock_path(conversation_id).unlink(missing_ok=True)
        try:
            self.cache_path(conversation_id).unlink(missing_ok=True)
        except OSError as e:
            reason = e.strerror or e
            raise StoreError(
                f"deleted conversation {conversation_id}, but not its cache file: {reason}"
            ) from None

    def turn(self, conversation_id: int) -> ContextManager[None]:
        """Hold the conversation for one turn, question to answer; ConversationBusy if another turn holds it.

        An advisory lock on a file next to the database (flock), released when the block ends
        or the process dies. Where the OS has no flock, nothing is held and `expected_leaf`
        alone guards the writes.
        """
        return _held(self._lock_path(conversation_id), conversation_id)

    def _lock_path(self, conversation_id: int) -> Path:
        return self.directory / "locks" / f"conversation-{conversation_id}.lock"

    def cache_path(self, conversation_id: int) -> Path:
        """Where the conversation's KV cache file lives: next to the database."""
        return self.directory / "kv-caches" / f"conversation-{conversation_id}.safetensors"

    # -- messages -----------------------------------------------------------------
    def add_message(
        self,
        conversation_id: int,
        role: str,
        content: str,
        parent_id: int | None | str = "leaf",
        record: AnswerRecord | None = None,
        expected_leaf: int | None | str = "any",
        make_leaf: bool = True,
    ) -> StoredMessage:
        """Append a finished message and make it the current leaf; committed when this returns.

        `parent_id` defaults to the current leaf (read in the same transaction, so two writers
        extend the branch one after the other); pass an id, or None for a new first message,
        to start a sibling branch (an edit or a regeneration). With `expected_leaf` (the leaf
        the writer last saw) the write happens only if the leaf is still that one, else
        ConversationChanged. `make_leaf=False` adds the message as a side version and leaves
        the current branch as it is.
        """
        _check_role(role)
        with self._write() as db:
            message_id = self._append(
                db, conversation_id, role, content, parent_id, record, expected_leaf, make_leaf
            )
        return self.message(message_id)

    def _append(
        self,
        db: sqlite3.Connection,
        conversation_id: int,
        role: str,
        content: str,
        parent_id: int | None | str,
        record: AnswerRecord | None,
        expected_leaf: int | None | str = "any",
        make_leaf: bool = True,
    ) -> int:
        """Insert a message inside the caller's transaction (and make it the leaf); its id."""
        now = time.time()
        conversation = db.execute("SELECT * FROM conversations WHERE id = ?", (conversation_id,)).fetchone()
        if conversation is None:
            raise StoreError(f"no conversation {conversation_id}")
        if expected_leaf != "any" and conversation["leaf_id"] != expected_leaf:
            raise ConversationChanged(
                f"conversation {conversation_id} changed: its last message is now "
                f"{conversation['leaf_id']}, not {expected_leaf}"
            )
        parent = conversation["leaf_id"] if parent_id == "leaf" else parent_id
        self._check_parent(db, conversation_id, parent)
        message_id = db.execute(
            "INSERT INTO messages (conversation_id, parent_id, role, content, created, "
            f"{', '.join(_RECORD_FIELDS)}) "
            f"VALUES (?, ?, ?, ?, ?, {', '.join('?' * len(_RECORD_FIELDS))})",
            (conversation_id, parent, role, content, now, *_record_values(record)),
        ).lastrowid
        title = conversation["title"] or (_title_from(content) if role == "user" else "")
        model = record.model if record else conversation["model"]
        precision = record.precision if record else conversation["precision"]
        db.execute(
            "UPDATE conversations SET leaf_id = ?, updated = ?, title = ?, model = ?, precision = ? "
            "WHERE id = ?",
            (
                message_id if make_leaf else conversation["leaf_id"],
                now,
                title,
                model,
                precision,
                conversation_id,
            ),
        )
        return message_id

    @staticmethod
    def _check_parent(db: sqlite3.Connection, conversation_id: int, parent_id: int | None) -> None:
        if parent_id is None:
            return
        row = db.execute("SELECT conversation_id FROM messages WHERE id = ?", (parent_id,)).fetchone()
        if row is None or row["conversation_id"] != conversation_id:
            raise StoreError(f"message {parent_id} is not in conversation {conversation_id}")

    def delete_message(self, message_id: int) -> None:
        """Remove a message that has no replies (a prompt the model refused); its parent becomes the leaf."""
        with self._write() as db:
            row = db.execute("SELECT * FROM messages WHERE id = ?", (message_id,)).fetchone()
            if row is None:
                return
            if db.execute("SELECT 1 FROM messages WHERE parent_id = ?", (message_id,)).fetchone():
                raise StoreError(f"message {message_id} has replies; delete the conversation instead")
            db.execute("DELETE FROM messages WHERE id = ?", (message_id,))
            db.execute(
                "UPDATE conversations SET leaf_id = ? WHERE id = ? AND leaf_id = ?",
                (row["parent_id"], row["conversation_id"], message_id),
            )

    def message(self, message_id: int) -> StoredMessage:
        with self._read() as db:
            row = db.execute("SELECT * FROM messages WHERE id = ?", (message_id,)).fetchone()
        if row is None:
            raise StoreError(f"no message {message_id}")
        return _message(row)

    def path(self, conversation_id: int, leaf_id: int | None | str = "leaf") -> list[StoredMessage]:
        """The messages from the first to `leaf_id` (default: the current leaf), in order."""
        if leaf_id == "leaf":
            leaf_id = self.conversation(conversation_id).leaf_id
        if leaf_id is None:
            return []
        with self._read() as db:
            rows = db.execute(
                """WITH RECURSIVE up(id, depth) AS (
                       SELECT id, 0 FROM messages WHERE id = ? AND conversation_id = ?
                       UNION ALL
                       SELECT m.parent_id, up.depth + 1 FROM messages m JOIN up ON m.id = up.id
                       WHERE m.parent_id IS NOT NULL)
                   SELECT m.* FROM up JOIN messages m ON m.id = up.id ORDER BY up.depth DESC""",
                (leaf_id, conversation_id),
            ).fetchall()
        return [_message(row) for row in rows]

    def messages(self, conversation_id: int) -> list[StoredMessage]:
        """Every message of every branch, oldest first."""
        with self._read() as db:
            query = "SELECT * FROM messages WHERE conversation_id = ? ORDER BY id"
            rows = db.execute(query, (conversation_id,)).fetchall()
        return [_message(row) for row in rows]

    # -- branches ---------------------------------------------------------------------
    def siblings(self, message_id: int) -> list[StoredMessage]:
        """The versions of a turn: messages with the same parent (this one included), oldest first."""
        target = self.message(message_id)
        with self._read() as db:
            rows = db.execute(
                "SELECT * FROM messages WHERE conversation_id = ? AND parent_id IS ? AND role = ? "
                "ORDER BY id",
                (target.conversation_id, target.parent_id, target.role),
            ).fetchall()
        return [_message(row) for row in rows]

    def switch_branch(self, message_id: int) -> list[StoredMessage]:
        """Make the branch through `message_id` current, down to its newest leaf; returns the new path."""
        target = self.message(message_id)
        with self._write() as db:
            leaf = message_id
            while child := db.execute(
                "SELECT id FROM messages WHERE parent_id = ? ORDER BY id DESC LIMIT 1", (leaf,)
            ).fetchone():
                leaf = child["id"]
            db.execute(
                "UPDATE conversations SET leaf_id = ?, updated = ? WHERE id = ?",
                (leaf, time.time(), target.conversation_id),
            )
        return self.path(target.conversation_id, leaf)

    # -- search and export -------------------------------------------------------------
    def search(self, text: str, limit: int = 50) -> list[SearchHit]:
        """Messages matching every word of `text` (the last word as a prefix), best first."""
        query = fts_query(text)
        if not query:
            return []
        # Match markers no message can forge (a fresh nonce each search): "[docs]" in a message stays text.
        nonce = secrets.token_hex(8)
        start, end = f"\ue000{nonce}", f"\ue001{nonce}"
        with self._read() as db:
            rows = db.execute(
                """SELECT m.conversation_id, c.title, m.id AS message_id, m.role,
                          snippet(messages_fts, 0, ?, ?, '…', 12) AS snippet
                   FROM messages_fts JOIN messages m ON m.id = messages_fts.rowid
                   JOIN conversations c ON c.id = m.conversation_id
                   WHERE messages_fts MATCH ? ORDER BY rank LIMIT ?""",
                (start, end, query, limit),
            ).fetchall()
        return [
            SearchHit(
                row["conversation_id"],
                row["title"],
                row["message_id"],
                row["role"],
                snippet_parts(row["snippet"], start, end),
            )
            for row in rows
        ]

    def export_json(self, conversation_id: int) -> dict[str, Any]:
        """Everything, every branch included: the conversation, its messages with parents,
        the current path."""
        conversation = self.conversation(conversation_id)
        return {
            "format": EXPORT_FORMAT,
            "version": SCHEMA_VERSION,
            "conversation": asdict(conversation),
            "current_path": [m.id for m in self.path(conversation_id)],
            "messages": [asdict(m) for m in self.messages(conversation_id)],
        }

    def export_markdown(self, conversation_id: int) -> str:
        """The current branch as Markdown, each answer followed by how it was made."""
        conversation = self.conversation(conversation_id)
        lines = [f"# {conversation.title or 'Untitled conversation'}", ""]
        lines.append(f"*Conversation {conversation.id}, started {_date(conversation.created)}*")
        lines.append("")
        if conversation.system_prompt:
            lines += ["## System", "", conversation.system_prompt, ""]
        for message in self.path(conversation_id):
            lines += [f"## {message.role.capitalize()}", "", message.content, ""]
            if message.record:
                lines += [f"*{describe_record(message.record)}*", ""]
        return "\n".join(lines)


@contextmanager
def _held(path: Path, conversation_id: int) -> Iterator[None]:
    if fcntl is None:
        yield
        return
    descriptor = _open_lock_file(path, conversation_id)
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConversationBusy(
                f"conversation {conversation_id} is being answered by another llmchat; "
                "try again when that answer has finished"
            ) from None
        yield
    finally:
        os.close(descriptor)  # lets go of the lock


def _open_lock_file(path: Path, conversation_id: int) -> int:
    """The descriptor of a conversation's lock file, made if missing."""
    try:
        path.parent.mkdir(exist_ok=True)
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:
        raise StoreError(f"cannot lock conversation {conversation_id}: {e.strerror or e}") from None


def describe_record(record: AnswerRecord) -> str:
    """One line: model, precision, sampling, how it was decoded, speed and why it stopped."""
    sampling = ", ".join(f"{k} {v}" for k, v in record.sampling.items() if v is not None)
    how = [
        f"KV cache {record.kv_cache}" if record.kv_cache else "",
        record.step_path or "",
        f"speculative {record.speculative}" if record.speculative else "",
        f"forked at step {record.fork_step + 1}" if record.fork_step is not None else "",
    ]
    rate = f"{record.decode_tok_s:.1f} tok/s" if record.decode_tok_s else "– tok/s"  # one token: no gap
    tokens = "token" if record.tokens == 1 else "tokens"
    return " · ".join(
        [
            f"{record.model} · {record.precision} · {sampling}",
            *(part for part in how if part),
            f"TTFT {record.ttft_s * 1000:.0f} ms · {rate} · {record.tokens} {tokens}",
            f"stop: {record.stop}",
        ]
    )


def _date(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp).strftime("%Y-%m-%d %H:%M")


def _check_role(role: str) -> None:
    if role not in ("user", "assistant"):
        raise StoreError(f"role must be user or assistant, got {role!r}")


def _insert_conversation(
    db: sqlite3.Connection, model: str | None, precision: str | None, system_prompt: str | None, title: str
) -> int:
    now = time.time()
    return db.execute(
        "INSERT INTO conversations (title, created, updated, model, precision, system_prompt)"
        " VALUES (?, ?, ?, ?, ?, ?)",
        (title, now, now, model, precision, system_prompt),
    ).lastrowid


def _record_values(record: AnswerRecord | None) -> tuple:
    if record is None:
        return (None,) * len(_RECORD_FIELDS)
    values = asdict(record)
    values["sampling"] = json.dumps(record.sampling, sort_keys=True)
    values["token_ids"] = None if record.token_ids is None else json.dumps(list(record.token_ids))
    return tuple(values[name] for name in _RECORD_FIELDS)


def _message(row: sqlite3.Row) -> StoredMessage:
    record = None
    if row["role"] == "assistant" and row["model"] is not None:
        values = {name: row[name] for name in _RECORD_FIELDS}
        values["sampling"] = json.loads(values["sampling"] or "{}")
        values["token_ids"] = _token_ids(values["token_ids"])
        record = AnswerRecord(**values)
    return StoredMessage(
        row["id"],
        row["conversation_id"],
        row["parent_id"],
        row["role"],
        row["content"],
        row["created"],
        record,
    )


def _token_ids(text: str | None) -> tuple[int, ...] | None:
    """An answer's stored ids; None where there are none or they are not ids (they only save a
    prefill: the text is the answer)."""
    try:
        ids = json.loads(text) if text else None
    except ValueError:
        return None
    ok = isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)
    return tuple(ids) if ok else None


def _statements(script: str) -> list[str]:
    """Split a schema script into statements (execute() runs one; executescript() would commit)."""
    statements, current = [], ""
    for line in script.strip().splitlines(keepends=True):
        current += line
        if sqlite3.complete_statement(current):
            statements.append(current.strip())
            current = ""
    return statements


_PATH_CTE = """
WITH RECURSIVE path(conversation_id, id, parent_id, role) AS (
    SELECT c.id, m.id, m.parent_id, m.role FROM conversations c JOIN messages m ON m.id = c.leaf_id
    UNION ALL
    SELECT p.conversation_id, m.id, m.parent_id, m.role FROM path p JOIN messages m ON m.id = p.parent_id
)"""
