"""Which server is at the URL, which model it serves, and what it says about them.

Detection asks in order: /v1/models (every server; `owned_by` names llama.cpp, vLLM and
SGLang), then the server's own endpoint for its version: llama.cpp's /props, vLLM's /version,
SGLang's /get_server_info, Ollama's /api/version. Anything else is a plain OpenAI-compatible
server, which still streams a chat, only with fewer panels fed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from engine.events import ServerInfo
from engine.remote import dialects
from engine.remote.cancel import CancelEvent
from engine.remote.client import RemoteClient, RemoteError
from engine.remote.dialects import Dialect
from engine.remote.request import OFF
from engine.remote.shape import LLAMA_SERVER_CACHE_BYTES, GgufShape, gguf_shape
from engine.remote.target import RemoteTarget


@dataclass(frozen=True)
class Server:
    """A detected server and the model chosen on it."""

    info: ServerInfo
    dialect: Dialect
    context: int | None
    """Tokens one conversation may hold on the server (its slot or max model length)."""
    shape: GgufShape | None
    cache_element_bytes: int | None
    parameters: int | None
    weight_bytes: int | None


def reach(target: RemoteTarget, stop: CancelEvent | None = None) -> tuple[RemoteClient, Server]:
    """A client to the server and what the server is; RemoteError says why not (its client is
    closed). Setting `stop` cuts the asking short: a quit while a server keeps silent."""
    client = RemoteClient(target)
    try:
        with client.connections.cut_on(stop or CancelEvent()):
            return client, detect(client, target.model)
    except RemoteError:
        client.close()
        raise


def detect(client: RemoteClient, wanted: str | None) -> Server:
    """Ask the server who it is; RemoteError if it cannot be reached or lacks the model."""
    entry = _model_entry(client, wanted)
    dialect = dialects.BY_OWNER.get(str(entry.get("owned_by", "")).lower())
    if dialect is None:
        dialect = dialects.OLLAMA if isinstance(client.probe_json("/api/version"), dict) else None
    if dialect is None and isinstance(client.probe_json("/props"), dict):
        dialect = dialects.LLAMA_CPP  # a llama-server renamed by a proxy still has /props
    detect_kind = {
        "llama.cpp": _llama_cpp,
        "vllm": _vllm,
        "sglang": _sglang,
        "ollama": _ollama,
    }.get(dialect.kind if dialect else "", _generic)
    return detect_kind(client, entry)


def _model_entry(client: RemoteClient, wanted: str | None) -> dict:
    listing = client.get_json("/models", v1=True)
    models = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(models, list) or not models:
        raise RemoteError(f"{client.shown}/models lists no models")
    entries = [m for m in models if isinstance(m, dict) and m.get("id")]
    if not entries:
        raise RemoteError(f"{client.shown}/models lists no model with an id")
    if wanted is None:
        return entries[0]
    for entry in entries:
        if entry["id"] == wanted or wanted in (entry.get("aliases") or ()):
            return entry
    names = ", ".join(str(m["id"]) for m in entries[:8])
    raise RemoteError(f"{client.shown} does not serve {wanted!r}; it serves: {names}")


def _info(client: RemoteClient, dialect: Dialect, entry: dict, **fields: Any) -> ServerInfo:
    return ServerInfo(
        url=client.shown,
        kind=dialect.kind,
        model=str(entry["id"]),
        top_k_note=dialect.top_k_note,
        unreported=dialect.unreported,
        unsupported_settings=tuple(name for name in OFF if name not in dialect.sampling_fields),
        **fields,
    )


def _llama_cpp(client: RemoteClient, entry: dict) -> Server:
    props = client.probe_json("/props") or {}
    meta = entry.get("meta") if isinstance(entry.get("meta"), dict) else {}
    settings = props.get("default_generation_settings") or {}
    slots = props.get("total_slots")
    unreported = list(dialects.LLAMA_CPP.unreported)
    if props.get("endpoint_metrics") is False:
        unreported.append("request counters (/metrics): start llama-server with --metrics")
    if props.get("endpoint_slots") is False:
        unreported.append("server-wide KV cache fill (summed from /slots): start llama-server with --slots")
    shape = gguf_shape(props.get("model_path"))
    if shape is None:
        unreported.append(
            "model shape (layers, KV heads): its GGUF is not readable here, so KV bytes per token "
            "are not computed"
        )
    info = _info(
        client,
        dialects.LLAMA_CPP,
        entry,
        version=props.get("build_info"),
        parallelism=f"{slots} parallel slot{'s' if slots != 1 else ''}" if isinstance(slots, int) else None,
        quantization=props.get("model_ftype") or meta.get("ftype"),
    )
    return Server(
        info=replace(info, unreported=tuple(unreported)),
        dialect=dialects.LLAMA_CPP,
        context=_int(settings.get("n_ctx")) or _int(meta.get("n_ctx")),
        shape=shape,
        cache_element_bytes=LLAMA_SERVER_CACHE_BYTES if shape else None,
        parameters=_int(meta.get("n_params")),
        weight_bytes=_int(meta.get("size")),
    )


def _vllm(client: RemoteClient, entry: dict) -> Server:
    version = (client.probe_json("/version") or {}).get("version")
    info = _info(client, dialects.VLLM, entry, version=version)
    return _plain(info, dialects.VLLM, entry)


def _sglang(client: RemoteClient, entry: dict) -> Server:
    about = client.probe_json("/get_server_info") or client.probe_json("/server_info") or {}
    sizes = [f"{name} {about[key]}" for key, name in _SGLANG_SIZES if _int(about.get(key))]
    info = _info(
        client,
        dialects.SGLANG,
        entry,
        version=about.get("version"),
        parallelism=", ".join(sizes) or None,
    )
    server = _plain(info, dialects.SGLANG, entry)
    return replace(server, context=server.context or _int(about.get("context_length")))


_SGLANG_SIZES = (
    ("tp_size", "tensor parallel"),
    ("pp_size", "pipeline parallel"),
    ("dp_size", "data parallel"),
)


def _ollama(client: RemoteClient, entry: dict) -> Server:
    version = _object(client.probe_json("/api/version")).get("version")
    version = version if isinstance(version, str) else None
    return _plain(_info(client, dialects.OLLAMA, entry, version=version), dialects.OLLAMA, entry)


def _generic(client: RemoteClient, entry: dict) -> Server:
    owner = entry.get("owned_by")
    info = _info(client, dialects.GENERIC, entry, version=f"owned_by {owner}" if owner else None)
    return _plain(info, dialects.GENERIC, entry)


def _plain(info: ServerInfo, dialect: Dialect, entry: dict) -> Server:
    """A server that tells its context length at most (vLLM and SGLang list max_model_len)."""
    return Server(
        info=info,
        dialect=dialect,
        context=_int(entry.get("max_model_len")),
        shape=None,
        cache_element_bytes=None,
        parameters=None,
        weight_bytes=None,
    )


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _object(value: Any) -> dict:
    """A JSON object a server sent, or {} where it sent something else (read as not reported)."""
    return value if isinstance(value, dict) else {}
