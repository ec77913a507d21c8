"""What the app starts with: the config file's defaults, overridden by command-line flags."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from engine import DEFAULT_MODEL
from tui.config import Config


@dataclass(frozen=True)
class AppOptions:
    model: str = DEFAULT_MODEL
    precision: str = "fp32"
    device: str = "auto"
    sampling: Mapping[str, Any] = field(default_factory=dict)
    """Sampling fields to set (validated on the engine thread, where torch is imported)."""
    system: str | None = None
    context: int | None = None
    theme: str = "llmchat-dark"
    theme_from_flag: bool = False
    """The theme came from `--theme`, so it is saved at start; one from the config file is never
    written back (a wrong-typed one there stays as the user wrote it)."""
    config_path: Path | None = None
    """Where the theme choice is saved; None means the user's config file."""
    cursor_blink: bool = True
    """Off in snapshot tests, so screenshots are stable."""
    resume: int | str | None = None
    """A saved conversation to continue once the model has loaded: an id, or 'last'."""
    speculative: str | None = None
    """Speculative decoding once the model has loaded: `lookup` or a draft MODEL[@PRECISION]; None is off."""
    draft_tokens: int = 4
    """Tokens drafted per speculative round (1..8)."""
    kv_cache: str | None = None
    """The KV cache's precision (fp32, bf16, fp16, int8); None keeps the model precision's own."""
    server: str | None = None
    """Chat with a model on this OpenAI-compatible server instead of loading one here."""
    api_key_env: str | None = None
    """With a server: the environment variable that holds its API key."""
    read_timeout_s: float = 120.0
    """With a server: how long it may stay silent mid-answer."""
    raw: bool = False
    """The prompt goes as raw text, no chat template (`--raw`): a base model continues it."""
    chat_template: str | None = None
    """`--chat-template`: a template name (engine/chat_templates.py) or a file, for a model without one."""
    thinking: bool | None = None
    """`--thinking on|off`: the chat template's `enable_thinking`; None leaves the template's default."""
    shots: str | None = None
    """Where Screenshot saves (`--shots`, config.json); None: `screenshots` in the data dir."""
    warm_first: bool = False
    """Hold the first question until the compiled decode step is ready (`llmchat lecture`)."""
    system_is_default: bool = False
    """`system` is llmchat's default for the built-in model (BUILT_IN_SYSTEM): the chat says so."""

    @property
    def template_text(self) -> str | None:
        """The chat template `chat_template` names (checked by the command line before the app starts)."""
        if self.chat_template is None:
            return None
        from engine.chat_templates import template_text

        return template_text(self.chat_template)

    @property
    def remote(self) -> bool:
        return self.server is not None

    def target(self):
        """Where the server is (engine.remote.target.RemoteTarget); only with `server` set."""
        from engine.remote.target import RemoteTarget

        model = self.model if self.model != DEFAULT_MODEL else None  # the server's first, unless named
        return RemoteTarget(self.server, model, self.api_key_env, read_timeout_s=self.read_timeout_s)


FROM_EITHER = (
    "model",
    "precision",
    "device",
    "system",
    "context",
    "theme",
    "speculative",
    "draft_tokens",
    "kv_cache",
    "server",
    "api_key_env",
    "shots",
)
"""The options a flag or the config file sets (a flag wins)."""


BUILT_IN_SYSTEM = "You are a helpful assistant. Keep answers short."
"""The system prompt of the built-in model where none is given. SmolLM2's template puts its own
("You are a helpful AI assistant named SmolLM, trained by Hugging Face") where a chat has none;
with it, at the card's sampling (T 0.2, top-p 0.9), "What is the capital of France?" was answered
right in 8 of 12 seeds, with this one in 12 of 12 (scripts/first_answer.py; issue 35: the first
answer a newcomer sees). `--system ''` keeps the template's own."""


def system_or_default(system: str | None, model: str, local_chat: bool) -> tuple[str | None, bool]:
    """(the system prompt to start with, whether it is llmchat's default for the built-in model).
    `local_chat`: the built-in model runs here with its own chat template (not a server, --raw or
    --chat-template)."""
    if system is None and model == DEFAULT_MODEL and local_chat:
        return BUILT_IN_SYSTEM, True
    return system, False


LECTURE = {"sampling": {"temperature": 0.0}, "system": BUILT_IN_SYSTEM}
"""`llmchat lecture`'s preset, between the config file and the flags: greedy, so the same question
gives the same answer in front of every class, and short answers a projector can show. SmolLM2 at
T 0 answered the demo's questions right in English with this prompt; "Answer briefly" made it
answer in French, "…in the language of the question" made it loop in French."""
LECTURE_THEME = "llmchat-high-contrast"


def options_from(config: Config, config_path: Path | None = None, **flags: Any) -> AppOptions:
    """Flags that are not None win over the config file (and `lecture=True`'s preset over both
    but the flags; a lecture's theme is never saved)."""
    lecture = bool(flags.pop("lecture", False))
    sampling = dict(config.sampling) | (LECTURE["sampling"] if lecture else {})
    sampling.update(flags.pop("sampling", None) or {})
    if lecture:
        flags["system"] = flags.get("system") or LECTURE["system"]
        flags["theme"] = flags.get("theme") or LECTURE_THEME
    chosen = {
        name: flags[name] if flags.get(name) is not None else getattr(config, name) for name in FROM_EITHER
    }
    chosen["theme_from_flag"] = flags.get("theme") is not None and not lecture
    chosen["warm_first"] = lecture
    if flags.get("read_timeout") is not None:
        chosen["read_timeout_s"] = flags["read_timeout"]
    chosen["raw"] = bool(flags.get("raw"))
    chosen["chat_template"] = flags.get("chat_template")
    chosen["thinking"] = thinking_wanted(flags.get("thinking"))
    local_chat = chosen["server"] is None and not chosen["raw"] and chosen["chat_template"] is None
    system, chosen["system_is_default"] = system_or_default(chosen["system"], chosen["model"], local_chat)
    chosen["system"] = system
    return AppOptions(sampling=sampling, config_path=config_path, resume=flags.get("resume"), **chosen)


def thinking_wanted(flag: str | None) -> bool | None:
    """`--thinking`'s value (on or off, checked before) as the engine takes it; None: not given."""
    return None if flag is None else flag == "on"
