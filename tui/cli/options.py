"""Every flag the commands share, declared once. A flag's default is None where the app's
config file or the command decides it, and its help says the default.

The seven sampling flags travel as one group: a command that takes a `sampling` parameter and is
decorated with `with_sampling` shows the seven flags in its place and receives the ones given as
one dict (typer reads a command's parameters from its signature, so the group is spliced there).
`bench --server`'s serving flags travel the same way (`with_serving`).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Optional

import typer

from engine.quant.precision import precision_help

Model = typer.Option(
    None,
    "--model",
    "-m",
    help="smollm2-135m (default), an HF model directory, a .gguf file or a hub id; "
    "with --server, one of the server's models (default: the first it lists).",
)
Precision = typer.Option(None, "--precision", "-p", help=precision_help() + " (default fp32).")
Device = typer.Option(None, "--device", help="auto (default), cpu or cuda.")
System = typer.Option(None, "--system", help="System prompt.")
Context = typer.Option(None, "--context", help="Limit the context window to this many tokens.")
Speculative = typer.Option(
    None,
    "--speculative",
    help="Speculative decoding (off by default): 'lookup' (n-gram match against the conversation) "
    "or a draft model, MODEL or MODEL@PRECISION, with the same tokenizer (default precision: w8 on a CPU).",
)
DraftTokens = typer.Option(
    None, "--draft-tokens", help="Tokens drafted per speculative round, 1..8 (default 4)."
)
KVCache = typer.Option(
    None,
    "--kv-cache",
    help="KV cache precision: fp32, bf16, fp16 or int8 (one scale per token and head); "
    "default: the model precision's own (fp32 on a CPU).",
)
Raw = typer.Option(
    False,
    "--raw",
    help="Send the text as it is, without the chat template: a base model continues it (a chat model "
    "shows what its template adds).",
)
ChatTemplate = typer.Option(
    None,
    "--chat-template",
    help="A chat template for a model that ships none: chatml, gemma, llama3, or a Jinja FILE.",
)
Thinking = typer.Option(
    None,
    "--thinking",
    help="on or off: the model thinks in a <think> block before it answers, or not, where its chat "
    "template reads enable_thinking (Qwen3, SmolLM3); default: the template's own.",
)
Server = typer.Option(
    None,
    "--server",
    help="Chat with a model on an OpenAI-compatible server (vLLM, SGLang, llama-server, Ollama), "
    "e.g. http://host:8000/v1.",
)
ApiKeyEnv = typer.Option(
    None, "--api-key-env", help="With --server: the environment variable that holds the API key."
)
ReadTimeout = typer.Option(
    None, "--read-timeout", help="With --server: seconds the server may stay silent mid-answer (default 120)."
)

SAMPLING: dict[str, tuple[Any, Any]] = {
    "temperature": (Optional[float], typer.Option(None, "--temperature", "-t", help="0 is greedy.")),
    "top_k": (
        Optional[int],
        typer.Option(None, "--top-k", help="Keep the k most probable tokens (0 = all)."),
    ),
    "top_p": (Optional[float], typer.Option(None, "--top-p", help="Nucleus sampling mass in (0, 1].")),
    "min_p": (
        Optional[float],
        typer.Option(None, "--min-p", help="Drop tokens below min_p x the top probability."),
    ),
    "repetition_penalty": (Optional[float], typer.Option(None, "--repetition-penalty", help="1 is off.")),
    "seed": (Optional[int], typer.Option(None, "--seed", help="Seed for reproducible sampling.")),
    "max_new_tokens": (
        Optional[int],
        typer.Option(None, "--max-new-tokens", "-n", help="Stop an answer after this many tokens."),
    ),
}
"""The sampling flags by SamplingSettings field: (type, option)."""


Percentiles = typer.Option(
    None, "--percentiles", help="Percentiles of TTFT, TPOT, ITL and E2EL to report (default 50,90,99)."
)
Goodput = typer.Option(
    None, "--goodput", help="SLOs (ms) a good request meets: ttft:500,tpot:50,e2el:2000 (or repeat it)."
)

SERVING: dict[str, tuple[Any, Any]] = {
    "num_prompts": (
        Optional[int],
        typer.Option(
            None, "--num-prompts", help="Serving benchmark (with --server): this many requests (16)."
        ),
    ),
    "request_rate": (
        Optional[str],
        typer.Option(
            None, "--request-rate", help="Serving: requests a second, gamma-spaced (default inf: at once)."
        ),
    ),
    "burstiness": (
        Optional[float],
        typer.Option(None, "--burstiness", help="Serving: 1 is Poisson (default), below 1 burstier."),
    ),
    "max_concurrency": (
        Optional[int],
        typer.Option(
            None, "--max-concurrency", help="Serving: at most this many requests in flight (no cap)."
        ),
    ),
    "dataset": (
        Optional[str],
        typer.Option(
            None, "--dataset", help='Serving: prompts from a file, one a line, or JSON Lines "prompt"s.'
        ),
    ),
    "input_len": (
        Optional[int],
        typer.Option(
            None, "--input-len", help="Serving: prompts of about this many tokens (default: questions)."
        ),
    ),
    "output_len": (
        Optional[int],
        typer.Option(
            None, "--output-len", help="Serving: exactly this many tokens an answer (default: to its end)."
        ),
    ),
    "percentiles": (Optional[str], Percentiles),
    "goodput": (Optional[list[str]], Goodput),
    "sweep": (
        Optional[str],
        typer.Option(
            None, "--sweep", help="Serving: repeat at each load: rate:1,2,4,inf or concurrency:1,2,4."
        ),
    ),
    "seed": (Optional[int], typer.Option(None, "--seed", help="Serving: the arrivals' seed (default 0).")),
}
"""`bench --server`'s serving flags (tui/cli/serving.py): (type, option)."""


def flag_group(
    group: str, flags: dict[str, tuple[Any, Any]]
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator: the command's parameter named `group` becomes `flags`; the command is called
    with `group` = {name: value} of the flags given."""

    def splice(command: Callable[..., Any]) -> Callable[..., Any]:
        own = inspect.signature(command, eval_str=True)
        parameters: list[inspect.Parameter] = []
        for parameter in own.parameters.values():
            if parameter.name != group:
                parameters.append(parameter)
                continue
            for name, (kind, option) in flags.items():
                parameters.append(inspect.Parameter(name, parameter.kind, default=option, annotation=kind))

        @functools.wraps(command)
        def grouped(**given: Any) -> Any:
            values = {name: given.pop(name) for name in flags}
            return command(**given, **{group: {k: v for k, v in values.items() if v not in (None, [])}})

        grouped.__signature__ = own.replace(parameters=parameters)  # type: ignore[attr-defined]
        grouped.__annotations__ = {p.name: p.annotation for p in parameters}
        return grouped

    return splice


with_sampling = flag_group("sampling", SAMPLING)
"""`command`, whose `sampling` parameter becomes the seven sampling flags."""
with_serving = flag_group("serving", SERVING)
"""`bench`, whose `serving` parameter becomes the serving benchmark's flags."""
