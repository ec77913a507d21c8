"""Chat templates by name, for a model that ships none (`--chat-template NAME|FILE`), as
llama.cpp's server names its built-in ones. Each is the family's published turn format written as
a Jinja template (what `apply_chat_template` renders); a FILE is any such template.

- chatml (SmolLM2, Qwen): <|im_start|>role\\ntext<|im_end|>\\n
- gemma (Gemma 2 and 3): <bos><start_of_turn>user\\ntext<end_of_turn>\\n, the answer's role is
  "model", and a system prompt goes at the top of the first user turn (Gemma has no system role)
- llama3: <|begin_of_text|><|start_header_id|>role<|end_header_id|>\\n\\ntext<|eot_id|>
"""

from __future__ import annotations

from pathlib import Path

NAMED = {
    "chatml": (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
    "gemma": (
        "{{ bos_token }}{% set ns = namespace(system='') %}"
        "{% for m in messages %}{% if m['role'] == 'system' %}{% set ns.system = m['content'] + '\\n\\n' %}"
        "{% else %}{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\\n' }}"
        "{{ ns.system + m['content'] | trim }}{% set ns.system = '' %}{{ '<end_of_turn>\\n' }}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
    ),
    "llama3": (
        "{{ bos_token }}{% for m in messages %}"
        "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' }}"
        "{{ m['content'] | trim + '<|eot_id|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
    ),
}

END_OF_TURN = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>")
"""The tokens these formats end a turn with: an answer stops at whichever the vocabulary has."""

MAX_FILE = 256 * 1024


def template_text(choice: str) -> str:
    """The template `--chat-template` names: one of NAMED, or a file's text; ValueError says why not."""
    if choice in NAMED:
        return NAMED[choice]
    path = Path(choice).expanduser()
    if not path.is_file():
        raise ValueError(
            f"--chat-template: {choice!r} is neither a template name ({', '.join(NAMED)}) nor a file"
        )
    try:
        if path.stat().st_size > MAX_FILE:
            raise ValueError(f"--chat-template: {choice} is over {MAX_FILE // 1024} KiB, not a chat template")
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        why = getattr(e, "strerror", None) or "not UTF-8 text"
        raise ValueError(f"--chat-template: cannot read {choice}: {why}") from None
    if "messages" not in text:
        raise ValueError(f"--chat-template: {choice} does not read `messages`, so it is no chat template")
    return text
