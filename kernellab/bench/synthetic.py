"""A servable checkpoint with random weights and a synthetic tokenizer, for benchmarks where no real one can be
downloaded (the GPU machine has no network).

``write_checkpoint(dir, shape)`` writes what a local model directory holds: ``config.json``, random bf16 weights
in ``model.safetensors`` (HF names, so the real safetensors loader reads them), and ``tokenizer.json`` +
``tokenizer_config.json`` (ChatML template). Every process of the stack then loads it the way it loads a real
checkpoint: the worker's engine through ``runtime.loader``, the gateway's tokenizer from the same folder.

The tokenizer is a byte-level BPE with exactly ``vocab_size`` ids, so every id the model can emit decodes:
word-like tokens grown from the byte alphabet by merges (each token is an existing token plus one letter, as
BPE merges build them), the 256 byte tokens, and the chat special tokens at the end. Decoding a token is the
real work of a real byte-level BPE (id → bytes → UTF-8), which is what the gateway's detokenizer pays per token.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from kernellab.runtime.request.registry import REGISTRY

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Shapes by name: the registry's own config for real models, and a tiny one for CPU rehearsals and CI.
TINY_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "vocab_size": 151936,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}


def shape_config(shape: str) -> dict:
    if shape == "tiny-qwen3":
        return dict(TINY_QWEN3)
    spec = REGISTRY.get(shape)
    if spec is None or spec.hf_config is None:
        raise ValueError(f"unknown shape {shape!r}: use tiny-qwen3 or a registry model with a config")
    return dict(spec.hf_config)


def _byte_alphabet() -> list[str]:
    """GPT-2's byte-to-unicode map (printable stand-ins for the 256 byte values), as byte-level BPE uses."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def build_tokenizer(vocab_size: int, seed: int = 0):
    """A ``tokenizers.Tokenizer`` (byte-level BPE) with ids 0 … vocab_size-1 all decodable."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    rng = random.Random(seed)
    alphabet = _byte_alphabet()
    space = alphabet[ord(" ")]
    letters = [alphabet[ord(c)] for c in "etaoinshrdlcumwfgypbvkjxqz"]
    weights = [13, 9, 8, 8, 7, 7, 6, 6, 6, 4, 4, 3, 3, 2, 2, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1]
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    merges: list[tuple[str, str]] = []
    n_regular = vocab_size - len(SPECIAL_TOKENS)
    grown = [space + c for c in letters] + letters  # word starts (with and without a leading space)
    for tok in grown:
        a, b = (tok[0], tok[1:]) if len(tok) > 1 else (None, None)
        if tok not in vocab and len(vocab) < n_regular:
            vocab[tok] = len(vocab)
            merges.append((a, b))
    tokens = list(grown)
    while len(vocab) < n_regular:
        base = (
            tokens[min(len(tokens) - 1, int(rng.expovariate(1 / 2000)))] if rng.random() < 0.7 else rng.choice(tokens)
        )
        if len(base) >= 12:
            continue
        new = base + rng.choices(letters, weights)[0]
        if new in vocab:
            continue
        vocab[new] = len(vocab)
        merges.append((base, new[-1]))
        tokens.append(new)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size
    return tok


def write_tokenizer(folder: Path, vocab_size: int, seed: int = 0) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    build_tokenizer(vocab_size, seed).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": CHATML,
                "eos_token": "<|im_end|>",
                "bos_token": None,
                "pad_token": "<|endoftext|>",
                "model_max_length": 131072,
            },
            indent=1,
        )
    )


def write_checkpoint(folder: str | Path, shape: str = "qwen3-0.6b", *, seed: int = 0, device: str = "cpu") -> Path:
    """config.json + random bf16 weights + the synthetic tokenizer in ``folder`` (made if missing)."""
    import torch
    from safetensors.torch import save_file

    from kernellab.runtime.config import ModelConfig

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg_dict = shape_config(shape)
    vocab = cfg_dict["vocab_size"]
    cfg_dict["eos_token_id"] = vocab - 1  # <|im_end|>, the last special token
    cfg = ModelConfig.from_hf(cfg_dict)
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape_):
        return (torch.randn(*shape_, generator=gen, device=device) * 0.02).to(torch.bfloat16).cpu()

    def norm(n):
        return (1.0 + 0.1 * torch.randn(n, generator=gen, device=device)).to(torch.bfloat16).cpu()

    h, q, kv = cfg.hidden_size, cfg.q_size, cfg.kv_size
    tensors = {"model.embed_tokens.weight": rand(vocab, h), "model.norm.weight": norm(h)}
    if not cfg.tie_word_embeddings:
        tensors["lm_head.weight"] = rand(vocab, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": norm(h),
            p + "post_attention_layernorm.weight": norm(h),
            p + "self_attn.q_proj.weight": rand(q, h),
            p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h),
            p + "self_attn.o_proj.weight": rand(h, q),
            p + "mlp.gate_proj.weight": rand(cfg.intermediate_size, h),
            p + "mlp.up_proj.weight": rand(cfg.intermediate_size, h),
            p + "mlp.down_proj.weight": rand(h, cfg.intermediate_size),
        }
        if cfg.qk_norm:
            tensors |= {
                p + "self_attn.q_norm.weight": norm(cfg.head_dim),
                p + "self_attn.k_norm.weight": norm(cfg.head_dim),
            }
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({**cfg_dict, "torch_dtype": "bfloat16"}, indent=1))
    write_tokenizer(folder, vocab, seed)
    return folder
