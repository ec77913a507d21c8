"""`llmchat top`'s engine side: a server's load, read poll after poll.

One poll reads the server's /metrics page (and llama.cpp's /slots) into a `Snapshot`: the
gauges as they are now (requests running and waiting, KV cache use) and the counters since the
server started (prompt and generated tokens, prefix-cache lookups and hits, drafted and accepted
tokens). Two snapshots give the `Rates` between them: a counter's growth over the seconds
between the polls. A counter that went down means the server restarted: that poll has no rates.
A figure the server does not send is None, never 0.

Which series feed which figure is data (`METRICS`, by `Dialect.kind`); the KV cache's gauge
names are the dialect's own (`fill_metrics`, or /slots where `fill_slots`).

llama.cpp adds a request's prompt tokens to its counter when the prompt is done and its
generated tokens when the request ends, so a counter alone says 0 tok/s while two slots
generate. /slots tells what each busy slot has done so far (`n_prompt_tokens_processed` while
`n_decoded` is 0, then `n_decoded`); those are added, read between two readings of the counters
so that a request ending meanwhile is counted once. A request cut off mid-answer (the client
left) takes its tokens out of that count: that poll's rate is low, or none.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields
from typing import Any

from engine.remote.cancel import CancelEvent
from engine.remote.client import RemoteClient, RemoteError
from engine.remote.dialects import Dialect
from engine.remote.metrics import series, slots_fill
from engine.remote.server import Server, reach
from engine.remote.target import RemoteTarget


@dataclass(frozen=True)
class ServerMetrics:
    """The /metrics series of one kind of server that feed the view (None: it sends none)."""

    running: str | None = None
    """Gauge: requests being decoded now."""
    waiting: str | None = None
    """Gauge: requests queued for a slot or for memory."""
    prompt_tokens: str | None = None
    """Counter: prompt tokens computed (llama.cpp: not those served from its cache)."""
    generated_tokens: str | None = None
    """Counter: tokens generated."""
    cache_hits: str | None = None
    """Counter: prompt tokens served from the prefix cache."""
    cache_queries: tuple[str, ...] = ()
    """Counters, summed: prompt tokens looked up in the prefix cache."""
    cache_hit_rate: str | None = None
    """Gauge 0..1: the server's own prefix-cache hit rate, where it sends a rate, not counters."""
    draft_tokens: str | None = None
    """Counter: tokens a speculative drafter proposed."""
    accepted_tokens: str | None = None
    """Counter: drafted tokens the model accepted."""
    accept_length: str | None = None
    """Gauge: tokens accepted per speculative step, on average."""
    counted_at_end: bool = False
    """The token counters grow only as a prompt or a request ends (llama.cpp): /slots adds the
    tokens of the requests in flight."""


AVERAGED = frozenset({"cache_hit_rate", "accept_length"})
"""Figures that are rates: a data-parallel server's engines are averaged; counts are summed."""

METRICS: dict[str, ServerMetrics] = {
    "llama.cpp": ServerMetrics(  # llama-server --metrics (names as its /metrics sends them)
        running="llamacpp:requests_processing",
        waiting="llamacpp:requests_deferred",
        prompt_tokens="llamacpp:prompt_tokens_total",
        generated_tokens="llamacpp:tokens_predicted_total",
        cache_hits="llamacpp:prompt_tokens_cached_total",
        cache_queries=("llamacpp:prompt_tokens_cached_total", "llamacpp:prompt_tokens_total"),
        draft_tokens="llamacpp:spec_decode_num_draft_tokens_total",
        accepted_tokens="llamacpp:spec_decode_num_accepted_tokens_total",
        counted_at_end=True,
    ),
    "vllm": ServerMetrics(
        running="vllm:num_requests_running",
        waiting="vllm:num_requests_waiting",
        prompt_tokens="vllm:prompt_tokens_total",
        generated_tokens="vllm:generation_tokens_total",
        cache_hits="vllm:prefix_cache_hits_total",
        cache_queries=("vllm:prefix_cache_queries_total",),
        draft_tokens="vllm:spec_decode_num_draft_tokens_total",
        accepted_tokens="vllm:spec_decode_num_accepted_tokens_total",
    ),
    "sglang": ServerMetrics(  # sglang --enable-metrics
        running="sglang:num_running_reqs",
        waiting="sglang:num_queue_reqs",
        prompt_tokens="sglang:prompt_tokens_total",
        generated_tokens="sglang:generation_tokens_total",
        cache_hit_rate="sglang:cache_hit_rate",
        accept_length="sglang:spec_accept_length",
    ),
}
"""By `Dialect.kind`; a kind not here (Ollama, other servers) reports none of these."""

COUNTERS = (
    "prompt_tokens",
    "generated_tokens",
    "cache_hits",
    "cache_queries",
    "draft_tokens",
    "accepted_tokens",
)


@dataclass(frozen=True)
class Slot:
    """One llama.cpp slot as /slots shows it."""

    id: int
    processing: bool
    held: int
    """Tokens whose K/V the slot holds (`n_prompt_tokens`: the prompt and the answer so far)."""
    n_ctx: int
    prefilled: int = 0
    """Prompt tokens computed so far by a request still in its prefill (not yet counted)."""
    decoded: int = 0
    """Tokens generated so far by the request in flight (not yet counted)."""


@dataclass(frozen=True)
class Snapshot:
    """One poll: each figure as the server reported it then, None where it did not."""

    at: float
    """time.monotonic() when the poll began."""
    running: float | None = None
    waiting: float | None = None
    kv_fill: float | None = None
    """Fraction of the server's KV cache in use, 0..1."""
    kv_source: str = ""
    """Where the fill came from (a gauge's name, or the /slots sum)."""
    prompt_tokens: float | None = None
    generated_tokens: float | None = None
    cache_hits: float | None = None
    cache_queries: float | None = None
    cache_hit_rate: float | None = None
    draft_tokens: float | None = None
    accepted_tokens: float | None = None
    accept_length: float | None = None
    slots: tuple[Slot, ...] | None = None
    """llama.cpp's slots; None for other servers, or where /slots is off."""
    notes: tuple[str, ...] = ()
    """Endpoints that answered with an error (e.g. llama-server without --metrics), one line each."""
    error: str | None = None
    """'server not answering: …' when it could not be reached; every figure is then None."""

    @property
    def prompt_so_far(self) -> float | None:
        """Prompt tokens computed, the requests in flight included."""
        if self.prompt_tokens is None:
            return None
        return self.prompt_tokens + sum(slot.prefilled for slot in self.slots or ())

    @property
    def generated_so_far(self) -> float | None:
        """Tokens generated, the requests in flight included."""
        if self.generated_tokens is None:
            return None
        return self.generated_tokens + sum(slot.decoded for slot in self.slots or ())


@dataclass(frozen=True)
class Rates:
    """What happened between two polls, per second or as a fraction (None: nothing to divide)."""

    seconds: float
    prompt_tps: float | None = None
    generation_tps: float | None = None
    cache_hit_rate: float | None = None
    """Prompt tokens served from the prefix cache / looked up (or the server's own rate)."""
    spec_acceptance: float | None = None
    """Drafted tokens accepted / drafted."""
    restarted: bool = False
    """A counter went down: the server restarted, so no rate this poll."""


def snapshot(client: RemoteClient, dialect: Dialect) -> Snapshot:
    """Poll the server once; a server that cannot be reached gives a snapshot with `error` set."""
    at = time.monotonic()
    notes: list[str] = []
    try:
        page, slots = _read(client, dialect, notes)
    except RemoteError as e:
        return Snapshot(at=at, error=f"server not answering: {e}")
    return assemble(page, slots, dialect, at, tuple(dict.fromkeys(notes)))


def assemble(
    page: dict[str, list[float]], slots: Any, dialect: Dialect, at: float, notes: tuple[str, ...] = ()
) -> Snapshot:
    """A snapshot from what the server sent: its /metrics series (`metrics.series` of `wanted`)
    and its /slots JSON (None where not read)."""
    names = METRICS.get(dialect.kind, ServerMetrics())
    fill, source = _fill(page, slots, dialect)
    return Snapshot(
        at,
        **_figures(page, names),
        kv_fill=fill,
        kv_source=source,
        slots=_slots(slots, in_flight=names.counted_at_end),
        notes=notes,
    )


def _read(client: RemoteClient, dialect: Dialect, notes: list[str]) -> tuple[dict[str, list[float]], Any]:
    """The /metrics series this view reads, and llama.cpp's /slots list (None where not read).
    Where the counters move only as requests end, they are read on both sides of /slots, and
    again (three tries) if a request ended in between, so that it is counted once."""
    names = METRICS.get(dialect.kind, ServerMetrics())
    names_read = wanted(dialect)
    page = _page(client, names_read, notes)
    if not dialect.fill_slots:
        return page, None
    for _ in range(3):
        slots = _get(client.get_json, "/slots", notes)
        if not names.counted_at_end:
            return page, slots
        again = _page(client, names_read, notes)
        settled = all(again.get(n) == page.get(n) for n in (names.prompt_tokens, names.generated_tokens))
        page = again
        if settled:
            break
    return page, slots


def wanted(dialect: Dialect) -> set[str]:
    """The /metrics names read from this kind of server."""
    names = METRICS.get(dialect.kind, ServerMetrics())
    found = set(dialect.fill_metrics)
    for spelled in (getattr(names, f.name) for f in fields(ServerMetrics)):
        if isinstance(spelled, str):
            found.add(spelled)
        elif isinstance(spelled, tuple):
            found.update(spelled)
    return found


def _page(client: RemoteClient, wanted: set[str], notes: list[str]) -> dict[str, list[float]]:
    """The wanted series of /metrics ({} where there is none to read)."""
    if not wanted:
        return {}
    text = _get(client.get_text, "/metrics", notes)
    found = series(text, wanted) if text is not None else {}
    if found is None:
        notes.append(f"{client.shown}: /metrics is no Prometheus page")
    return found or {}


def _get(call: Any, path: str, notes: list[str]) -> Any:
    """`call(path)`; an endpoint that answers an error is a note and None, a server that does not
    answer raises RemoteError."""
    try:
        return call(path)
    except RemoteError as e:
        if e.status is None:
            raise
        notes.append(f"{path}: {e}")
        return None


def _figures(page: dict[str, list[float]], names: ServerMetrics) -> dict[str, Any]:
    """Each figure of `names` from the page: the sum of its series (the mean for a rate), None
    where the page lacks any of the names it is summed from."""
    figures: dict[str, Any] = {}
    for f in fields(ServerMetrics):
        spelled = getattr(names, f.name)
        if isinstance(spelled, bool):
            continue
        spelled = (spelled,) if isinstance(spelled, str) else spelled or ()
        values = [v for name in spelled for v in page.get(name, ())]
        present = bool(spelled) and all(name in page for name in spelled)
        if not present or not values:
            figures[f.name] = None
        else:
            figures[f.name] = sum(values) / len(values) if f.name in AVERAGED else sum(values)
    return figures


def _fill(page: dict[str, list[float]], slots: Any, dialect: Dialect) -> tuple[float | None, str]:
    """The KV cache's fill, as the chat's KV panel reads it (engine/remote/metrics.py)."""
    if dialect.fill_slots:
        return slots_fill(slots) if slots is not None else (None, "")
    for name in dialect.fill_metrics:
        values = page.get(name)
        if values:
            mean = sum(values) / len(values)
            return (mean / 100 if dialect.fill_is_percent else mean), name
    return None, ""


def _slots(raw: Any, in_flight: bool) -> tuple[Slot, ...] | None:
    """/slots as records (with the tokens of the requests in flight where `in_flight`); None where
    it is no list of slots (a server's JSON: anything may come)."""
    if not isinstance(raw, list) or not raw:
        return None
    slots = tuple(_slot(entry, index, in_flight) for index, entry in enumerate(raw))
    return None if None in slots else slots  # type: ignore[return-value]


def _slot(entry: Any, index: int, in_flight: bool) -> Slot | None:
    """One entry of /slots; None where it has no context size."""
    if not isinstance(entry, dict) or not _count(entry.get("n_ctx")):
        return None
    counting = entry.get("is_processing") is True and in_flight
    progress = entry.get("next_token")
    progress = progress[0] if isinstance(progress, list) and progress else None
    decoded = (_count(progress.get("n_decoded")) if isinstance(progress, dict) else None) or 0
    prefilled = (_count(entry.get("n_prompt_tokens_processed")) or 0) if not decoded else 0
    slot_id = _count(entry.get("id"))
    return Slot(
        id=index if slot_id is None else slot_id,
        processing=entry.get("is_processing") is True,
        held=_count(entry.get("n_prompt_tokens")) or 0,
        n_ctx=entry["n_ctx"],
        prefilled=prefilled if counting else 0,
        decoded=decoded if counting else 0,
    )


def _count(value: Any) -> int | None:
    """A non-negative integer from JSON, or None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def rates(before: Snapshot, after: Snapshot) -> Rates:
    """The rates between two polls; none where either failed or a counter went down (a restart)."""
    seconds = after.at - before.at
    if before.error or after.error or seconds <= 0:
        return Rates(seconds)
    grown = {name: _delta(getattr(before, name), getattr(after, name)) for name in COUNTERS}
    if any(delta is not None and delta < 0 for delta in grown.values()):
        return Rates(seconds, restarted=True)
    hit_rate = after.cache_hit_rate  # the server's own, where it sends one
    if hit_rate is None:
        hit_rate = _ratio(grown["cache_hits"], grown["cache_queries"])
    return Rates(
        seconds,
        prompt_tps=_per_second(_delta(before.prompt_so_far, after.prompt_so_far), seconds),
        generation_tps=_per_second(_delta(before.generated_so_far, after.generated_so_far), seconds),
        cache_hit_rate=hit_rate,
        spec_acceptance=_ratio(grown["accepted_tokens"], grown["draft_tokens"]),
    )


def _delta(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else after - before


def _per_second(delta: float | None, seconds: float) -> float | None:
    """A counter's growth per second; None where unknown or negative (a request cut off in flight)."""
    return delta / seconds if delta is not None and delta >= 0 else None


def _ratio(part: float | None, whole: float | None) -> float | None:
    return part / whole if part is not None and whole and whole > 0 else None


@dataclass(frozen=True)
class Reading:
    """A poll and the rates since the poll before it (None on the first)."""

    snapshot: Snapshot
    rates: Rates | None


class Watch:
    """A server watched poll after poll, from one thread."""

    def __init__(self, client: RemoteClient, server: Server):
        self.client = client
        self.server = server
        self._last: Snapshot | None = None

    def poll(self) -> Reading:
        now = snapshot(self.client, self.server.dialect)
        before, self._last = self._last, now
        return Reading(now, rates(before, now) if before is not None else None)

    def close(self) -> None:
        self.client.close()


def watch(target: RemoteTarget, stop: CancelEvent | None = None) -> Watch:
    """Reach the server and learn what it is (as a chat connects); RemoteError says why not
    (setting `stop` cuts the asking short)."""
    return Watch(*reach(target, stop))
