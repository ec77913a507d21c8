"""A tiny random-weight Llama with a byte-level BPE tokenizer, built in seconds for tests."""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = [
    "The capital of France is Paris. The capital of Germany is Berlin.",
    "How does inference work? Prefill then decode, one token at a time.",
    "unhappiness happiness happy unhappy the a an of to in is it",
    "추론은 어떻게 작동하나요? 🤖 x² ∑ café naïve",
] * 20


def build_tiny_model(
    directory: Path,
    layers: int = 2,
    hidden: int = 64,
    seed: int = 0,
    tied: bool = False,
    family: str = "llama",
    config: dict | None = None,
) -> Path:
    """Write an HF model directory (config, random weights, tokenizer) and return it (`tied`: the
    LM head is the embedding table, as SmolLM2's; `family`: a transformers model_type of the
    fast path's families, engine/fast/families.py; `config`: more settings of its config)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(CORPUS, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    torch.manual_seed(seed)
    settings = {**FAMILY_CONFIG.get(family, {"sliding_window": None}), **(config or {})}
    model_config = _config_class(family)(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=tied,
        **settings,
    )
    model = AutoModelForCausalLM.from_config(model_config)
    # Random weights are near-uniform; sharpen them so top-k and greedy choices are distinct.
    with torch.no_grad():
        model.lm_head.weight.mul_(30)
        if family != "llama":  # norms start at one and biases near zero: make them count
            for name, parameter in model.named_parameters():
                if "norm" in name:
                    parameter.uniform_(0.5, 1.5)
                elif name.endswith(".bias"):
                    parameter.normal_(0, 0.5)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


FAMILY_CONFIG = {
    "llama": {},
    # A window shorter than a test's prompt and answer, so it decides what a token sees.
    "phi3": {"sliding_window": 8},
    # One local layer (a window, RoPE base 10k) and one global (base 1M), and an attention scale
    # of its own (1/sqrt(24), not 1/sqrt(head_dim)), as Gemma 3's are.
    "gemma3_text": {
        "sliding_window": 6,
        "layer_types": ["sliding_attention", "full_attention"],
        "query_pre_attn_scalar": 24,
    },
}
"""What a family's config sets beyond the shared sizes (default: no sliding window)."""


def _config_class(family: str):
    import transformers

    names = {
        "llama": "LlamaConfig",
        "mistral": "MistralConfig",
        "qwen2": "Qwen2Config",
        "qwen3": "Qwen3Config",
        "gemma3_text": "Gemma3TextConfig",
        "phi3": "Phi3Config",
    }
    return getattr(transformers, names[family])
