"""Resolving and loading models: clear one-line errors, and every precision that can run here."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import models
from engine.chat_templates import NAMED
from engine.events import TokenSampled, TurnFinished
from engine.models import ModelError
from engine.quant import load_16bit
from engine.quant.precision import PRECISIONS, PrecisionError
from engine.sampling import SamplingSettings
from engine.session import ChatSession
from tests.tiny import build_tiny_model

LLMCHAT = [sys.executable, "-m", "tui.cli"]
ROOT = Path(__file__).resolve().parent.parent


def one_line(error: BaseException) -> str:
    message = str(error)
    assert message and "\n" not in message and "Traceback" not in message
    return message


def test_missing_gguf_file(tmp_path):
    with pytest.raises(ModelError) as error:
        models.load(str(tmp_path / "missing.gguf"), "fp32", "cpu")
    message = one_line(error.value)
    assert "not found" in message and "missing.gguf" in message
    assert "smollm2-135m" in message  # says what would work


@pytest.mark.parametrize("spec", ["./no/such/model", "/no/such/dir/model", "~/no-such-model-here"])
def test_missing_path(spec):
    with pytest.raises(ModelError) as error:
        models.load(spec, "fp32", "cpu")
    message = one_line(error.value)
    assert spec in message and "smollm2-135m" in message


def test_directory_without_config(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    with pytest.raises(ModelError) as error:
        models.load(str(tmp_path), "fp32", "cpu")
    message = one_line(error.value)
    assert "config.json" in message and str(tmp_path) in message


def test_corrupt_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # keep the user's cache untouched
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + os.urandom(2000))
    with pytest.raises(ModelError) as error:
        models.load(str(broken), "fp32", "cpu")
    message = one_line(error.value)
    assert "cannot read GGUF" in message and "broken.gguf" in message
    assert not models.converted_dir(broken).exists()  # no half-converted model is left to load later


def test_garbage_that_is_not_even_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    text = tmp_path / "notes.gguf"
    text.write_text("this is not a model\n" * 50)
    with pytest.raises(ModelError) as error:
        models.load(str(text), "fp32", "cpu")
    assert "cannot read GGUF" in one_line(error.value)


def test_model_without_chat_template(tiny_model_dir, tmp_path):
    """A base model cannot hold a conversation: say so at load time instead of crashing at the first turn."""
    base = shutil.copytree(tiny_model_dir, tmp_path / "base-model")
    (base / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((base / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError) as error:
        models.load(str(base), "fp32", "cpu")
    message = one_line(error.value)
    assert "no chat template" in message and str(base) in message
    assert "pass --raw" in message and "--chat-template NAME|FILE" in message
    assert not models.load(str(base), "fp32", "cpu", chat=False).tokenizer.chat_template  # --raw takes it
    given = models.load(str(base), "fp32", "cpu", chat_template=NAMED["chatml"])
    assert given.tokenizer.chat_template == NAMED["chatml"]


@pytest.mark.parametrize("fast_only", [False, True])
def test_a_corrupt_tokenizer_is_one_line(tiny_model_dir, tmp_path, fast_only):
    """A tokenizer.json cut short: neither engine/chat_tokenizer.py nor transformers reads it, and
    the app's load (and `ask`'s) says so in one line."""
    broken = shutil.copytree(tiny_model_dir, tmp_path / "broken-tokenizer")
    text = (broken / "tokenizer.json").read_text()
    (broken / "tokenizer.json").write_text(text[: len(text) // 2])
    with pytest.raises(ModelError) as error:
        models.load(str(broken), "fp32", "cpu", fast_only=fast_only)
    assert one_line(error.value).startswith(f"cannot load {broken} at fp32: ")


def test_hub_id_offline_fails_with_alternatives(tmp_path):
    """Through the CLI a user sees one line on stderr and a non-zero exit, not a traceback."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "LLMCHAT_DATA_DIR": str(tmp_path),
    }
    done = subprocess.run(
        [*LLMCHAT, "ask", "hi", "--model", "no-such-org/no-such-model-xyz", "--device", "cpu"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "no-such-org/no-such-model-xyz" in lines[0] and "hub" in lines[0]
    assert "smollm2-135m" in lines[0]


def test_resolve_kinds(tiny_model_dir, tmp_path):
    assert models.resolve("smollm2-135m").kind == "gguf"
    assert models.resolve(str(tiny_model_dir)) == models.ModelSource(
        "dir", str(Path(tiny_model_dir).resolve())
    )
    assert models.resolve("HuggingFaceTB/SmolLM2-135M-Instruct").kind == "hub"
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"x")
    assert models.resolve(str(gguf)) == models.ModelSource("gguf", str(gguf.resolve()))


def test_unknown_precision(tiny_model_dir):
    with pytest.raises(PrecisionError) as error:
        models.load(str(tiny_model_dir), "fp8", "cpu")
    message = one_line(error.value)
    assert "fp8" in message
    assert all(name in message for name in PRECISIONS)


def test_unknown_device(tiny_model_dir):
    with pytest.raises(PrecisionError, match="auto, cpu or cuda"):
        models.load(str(tiny_model_dir), "fp32", "tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_gpu(tiny_model_dir):
    with pytest.raises(PrecisionError) as error:
        models.load(str(tiny_model_dir), "fp32", "cuda")
    message = one_line(error.value)
    assert "no CUDA GPU" in message and "--device cpu" in message


def test_auto_device_without_gpu_is_cpu(tiny_loaded):
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert tiny_loaded.info.device == expected == str(next(tiny_loaded.model.parameters()).device.type)


def test_info_describes_the_tiny_model(tiny_loaded):
    info = tiny_loaded.info
    config = tiny_loaded.model.config
    assert (info.layers, info.heads, info.kv_heads, info.head_dim) == (2, 4, 2, 16)
    assert info.parameters == sum(p.numel() for p in tiny_loaded.model.parameters())
    tensors = [*tiny_loaded.model.parameters(), *tiny_loaded.model.buffers()]
    assert info.weight_bytes == sum(t.numel() * t.element_size() for t in tensors)  # real bytes, fp32
    assert info.context == config.max_position_embeddings
    assert info.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4


def _bitsandbytes_runs_on_cpu() -> bool:
    try:
        import bitsandbytes.functional as bnb_f

        bnb_f.quantize_4bit(torch.randn(64, 64), quant_type="nf4")
        return True
    except Exception:
        return False


@pytest.mark.skipif(not _bitsandbytes_runs_on_cpu(), reason="bitsandbytes cannot run on this machine")
@pytest.mark.parametrize("precision", ["int8", "nf4", "w8a8"])
def test_quantized_precisions_load_and_generate(tiny_model_dir, tiny_loaded, precision):
    loaded = models.load(str(tiny_model_dir), precision, "cpu")
    assert loaded.info.precision == precision
    assert loaded.info.weight_bytes < tiny_loaded.info.weight_bytes  # the point of quantizing
    assert loaded.info.parameters == tiny_loaded.info.parameters
    chat = ChatSession(loaded, SamplingSettings(temperature=0, max_new_tokens=6))
    events = list(chat.send("The capital of France"))
    tokens = [e for e in events if isinstance(e, TokenSampled)]
    assert len(tokens) == 6 and events[-1].stats.stop == "length"
    assert isinstance(events[-1], TurnFinished)
    assert all(t.top_k and t.top_k[0].id == t.id for t in tokens)  # greedy from a real distribution
    assert chat.cache.tensor_bytes() == len(chat.cache) * loaded.info.kv_bytes_per_token


@pytest.mark.parametrize("precision, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_half_precisions_load_and_generate(tiny_model_dir, precision, dtype):
    loaded = models.load(str(tiny_model_dir), precision, "cpu")
    assert next(loaded.model.parameters()).dtype == dtype
    assert loaded.info.cache_element_bytes == 4  # on a CPU the cache stays fp32 (engine/quant/precision.py)
    chat = ChatSession(loaded, SamplingSettings(temperature=0, max_new_tokens=4))
    events = list(chat.send("hello"))
    assert events[-1].stats.generated_tokens == 4


def test_progress_is_reported(tiny_model_dir):
    stages = []
    models.load(str(tiny_model_dir), "fp32", "cpu", progress=lambda stage, fraction: stages.append(fraction))
    assert stages[0] == 0.0 and stages[-1] == 1.0
    assert stages == sorted(stages)


@pytest.mark.real_model
@pytest.mark.parametrize("precision, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_16_bit_from_float32_files_is_what_transformers_loads_with_less_memory(precision, dtype):
    # The built-in model's files are float32: mapped as stored, then narrowed one tensor at a time
    # (engine/quant/load_16bit.py) rather than converted by transformers with the whole file resident.
    from transformers import AutoModelForCausalLM

    loaded = models.load(models.DEFAULT_MODEL, precision, "cpu")
    directory = loaded.model.name_or_path
    assert load_16bit.stored_dtype(directory) == "F32"
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
    ours = dict(loaded.model.named_parameters(remove_duplicate=False))
    theirs = dict(reference.named_parameters(remove_duplicate=False))
    assert ours.keys() == theirs.keys()
    for name, param in theirs.items():
        assert ours[name].dtype == dtype and torch.equal(ours[name], param), name
    # The head and the embedding are one tensor in SmolLM2: still one, not two copies.
    assert loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight
    assert loaded.info.weight_bytes == reference.get_memory_footprint()


@pytest.mark.real_model
def test_a_16_bit_load_never_holds_the_float32_file_and_its_copies_together():
    script = """
import json
from engine import models
from engine.bench import peak_memory_bytes
def peak():
    return peak_memory_bytes("cpu")
models.load(models.DEFAULT_MODEL, "fp32", "cpu")  # imports done, the converted files cached
before = peak()
loaded = models.load(models.DEFAULT_MODEL, "bf16", "cpu")
print(json.dumps({"grew": peak() - before, "weights": loaded.info.weight_bytes}))
"""
    # After an fp32 load (imports done, the files cached), a bf16 load grows the peak by its own
    # weights and one float32 tensor at a time: 238 MiB for 256 MiB of weights here. Converted
    # by transformers, the float32 file (2x the weights) was resident beside them: 771 MiB, 3x.
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-500:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["grew"] < 1.5 * result["weights"]


def test_a_changed_gguf_leaves_no_stale_conversion_behind(tmp_path, monkeypatch):
    # Every reinstall of the built-in model's package rewrites its GGUF (a new mtime), so each
    # converted it again (~0.5 GB) and kept the old copies: ten of them on a developer's machine.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    elsewhere = tmp_path / "other" / "model.gguf"  # the same name, another file: its copy stays
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(b"GGUF")

    def conversion(of: Path, marked: bool = True) -> Path:
        directory = models.converted_dir(of)
        directory.mkdir(parents=True)
        (directory / "config.json").write_text("{}")
        if marked:
            (directory / models.SOURCE_FILE).write_text(str(of.resolve()))
        return directory

    before_reinstall = conversion(gguf)
    made_by_an_older_llmchat = conversion(elsewhere, marked=False).rename(
        models.converted_dir(gguf).parent / "model-0123456789abcdef"
    )
    others = conversion(elsewhere)
    staging = (models.converted_dir(gguf).parent / "model-fedcba9876543210.tmp123").resolve()
    staging.mkdir()
    (staging / "config.json").write_text("{}")  # another process converting right now
    os.utime(gguf, ns=(10**18, 10**18))  # reinstalled
    current = conversion(gguf)
    assert models.convert_gguf(gguf, lambda *a: None) == current  # cached: nothing converted
    assert current.exists() and others.exists() and staging.exists()
    assert not before_reinstall.exists() and not made_by_an_older_llmchat.exists()


def test_random_weights_keep_the_architecture_and_are_written_once(tiny_model_dir, tmp_path, monkeypatch):
    """What `bench --random-weights` and gpu_check.sh measure: the model's shape, other weights,
    written once into the cache dir and loaded from there after."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    directory = models.random_weights_dir(str(tiny_model_dir))
    assert directory.is_relative_to(tmp_path) and (directory / "config.json").is_file()
    written = (directory / "model.safetensors").stat().st_mtime_ns
    assert models.random_weights_dir(str(tiny_model_dir)) == directory
    assert (directory / "model.safetensors").stat().st_mtime_ns == written

    random = models.load_random(str(tiny_model_dir), "fp32", "cpu")
    tiny = models.load(str(tiny_model_dir), "fp32", "cpu")
    assert random.info.name.endswith("(random weights)")
    assert (random.info.layers, random.info.hidden_size, random.info.parameters) == (
        tiny.info.layers,
        tiny.info.hidden_size,
        tiny.info.parameters,
    )
    embedding = random.model.get_input_embeddings().weight
    assert not torch.equal(embedding, tiny.model.get_input_embeddings().weight)


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_a_model_keeps_transformers_own_layers_and_fetches_no_hub_kernels(tiny_model_dir, precision):
    """transformers 5.x kernelizes a model by default with layers fetched from the hub: on a GPU an
    int8 or nf4 load failed offline ("could not verify publisher trust"), and elsewhere the layers
    the instruments describe would not be the ones that ran."""
    loaded = models.load(str(tiny_model_dir), precision, "cpu")
    assert loaded.model.use_kernels is False


@pytest.mark.parametrize("precision", ["fp32", "w8", "w8a8"])
def test_a_load_for_the_weights_alone_skips_the_tokenizer_unless_quantizing_needs_it(tmp_path, precision):
    """The compile child wants the weights alone: transformers' tokenizer for Gemma 3's 262k entries
    took ~2.6 s of its cold start. w8a8 calibrates on text, so it still reads one."""
    directory = build_tiny_model(tmp_path, family="gemma3_text")  # its tokenizer: transformers'
    alone = models.load(str(directory), precision, "cpu", fast_only=True, chat=False, tokenizer=False)
    whole = models.load(str(directory), precision, "cpu", fast_only=True, chat=False)
    assert (alone.tokenizer is None) == (precision != "w8a8")
    assert whole.tokenizer is not None
    mine, theirs = alone.model.state_dict(), whole.model.state_dict()
    assert mine.keys() == theirs.keys()
    for name, tensor in mine.items():
        assert torch.equal(tensor, theirs[name]), name
