"""Model and engine configuration: frozen, validated once, derived values as properties."""

from __future__ import annotations

from dataclasses import dataclass

from kernellab.runtime.op_names import REPLACEABLE
from kernellab.runtime.request.errors import ConfigError

SUPPORTED_ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "qwen3" | "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: dict | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in ("qwen3", "llama"):
            raise ConfigError(f"unsupported architecture {self.architecture!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")

    @property
    def qk_norm(self) -> bool:
        return self.architecture == "qwen3"

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_parameters(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i + 2 * h
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        return v * h * (1 if self.tie_word_embeddings else 2) + self.num_layers * per_layer + h

    def kv_bytes_per_token(self, dtype_bytes: int, scale_bytes: int = 0) -> int:
        """K and V bytes one token takes over all layers; ``scale_bytes`` per (token, KV head) row for an 8-bit
        (FP8 or int8) cache's scales."""
        return 2 * self.num_layers * (self.kv_size * dtype_bytes + self.num_kv_heads * scale_bytes)

    @classmethod
    def from_hf(cls, cfg: dict) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            arch = {"qwen3": "qwen3", "llama": "llama"}.get(cfg.get("model_type", ""))
        if arch is None:
            raise ConfigError(f"unsupported model: architectures={archs}, model_type={cfg.get('model_type')}")
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rope_scaling=_rope_scaling(cfg),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
        )


def _rope_scaling(cfg: dict) -> dict | None:
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise ConfigError(f"unsupported rope scaling {kind!r}")
    return dict(scaling)


KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "int8")


def default_block_size(kv_cache_dtype: str) -> int:
    """The KV block size an engine takes when none is given: 64 tokens for the int8 cache, whose decode attention
    copies one whole block a tile by TMA (offline workload +4.4 % over 16-token blocks read by the pointer forms on
    an H100: results/gpu/engine_h200_dev/knob_ab_int8_bs64_tma_offline_h100_0decfa7.json), 16 for the others."""
    return 64 if kv_cache_dtype == "int8" else 16


@dataclass(frozen=True)
class EngineConfig:
    """How to run one model. "auto" values are resolved once by the engine."""

    model: str = "smollm2-135m"
    device: str = "auto"  # "cpu" | "cuda" | "auto"
    dtype: str = "auto"  # "float32" | "bfloat16" | "float16" | "auto"
    max_model_len: int | None = None  # None: the registry's (or the checkpoint's) context length
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # Tokens a KV block holds (a power of two). 0: 64 for the int8 cache (its decode attention reads one block a tile
    # through tensor descriptors: kernels/paged_attention.py INT8_LAUNCH["tma"]), 16 for the others.
    block_size: int = 0
    num_kv_blocks: int | None = None  # None: sized from kv_cache_memory_gib (CPU) or free memory (GPU)
    kv_cache_memory_gib: float | None = None
    gpu_memory_utilization: float = 0.85
    # "auto": the cache in the model's dtype. "fp8" (alias "fp8_e4m3"): float8 e4m3 values with one fp32 scale
    # per token and KV head, written when K/V are stored and read directly by the decode attention: ~half the
    # cache bytes per token, so twice the tokens in the same memory and half the bytes a decode step reads.
    # "int8": the same bytes and scales, values in uniform steps of amax / 127 (less loss than e4m3's 3
    # significant bits for K and V as models make them: docs/gpu-engine.md).
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # While interactive requests are live, background (Batch API) prefill takes at most this many tokens per
    # step and none in a step that prefills an interactive request (runtime/request/scheduler.py). None: a sixteenth of
    # max_num_batched_tokens.
    background_prefill_tokens: int | None = None
    backend: str = "auto"  # "auto" (Triton dispatcher on GPU, torch on CPU) | "torch" | "triton"
    kernels: str = "accepted"  # "accepted" | "experimental" | "none": which Triton ops the dispatcher enables
    disabled_kernels: tuple[str, ...] = ()  # ops kept on torch whatever their status (ablations)
    cuda_graphs: bool = True
    # Steps that prefill replay CUDA graphs of the forward's row-wise pieces, captured per token bucket up to
    # max_num_batched_tokens, with attention eager in between (runtime/graphs.py PiecewiseGraphs); needs cuda_graphs.
    piecewise_graphs: bool = True
    # Steps of several fresh prompts (a burst's first step) replay one whole-step graph per (tokens, prompts) bucket
    # (runtime/graphs.py FRESH_*_BUCKETS) instead of the piecewise graphs' ~85 launches; needs cuda_graphs.
    fresh_prompt_graphs: bool = True
    # Greedy decode steps run back to back on the GPU between host syncs (vLLM's multi-step scheduling): the
    # host's per-step Python cost is paid once per window. 0 = auto: with CUDA graphs 4 under async_scheduling (whose
    # look-ahead hides the host's turn-around, so shorter windows only shorten an arrival's wait), else 8; 1 without.
    num_scheduler_steps: int = 0
    # Asynchronous scheduling: a decode window's next window is launched before its tokens are read, so the device
    # decodes on while the host reads, emits and schedules (no request waiting, every row running on). A request
    # that arrives meanwhile joins one window later than it would otherwise.
    async_scheduling: bool = True
    # "int4": on a CPU, a GGUF checkpoint's Q4_1 linears are also kept as their 4-bit codes (runtime/quant.py)
    # and steps of at most int4_max_rows rows (decode at small batch) read those instead of the dense weights.
    weight_quant: str = "none"  # "none" | "int4"
    int4_max_rows: int = 4
    random_weights: bool = False  # build the model's exact shape with random weights (GPU benchmarks)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.block_size == 0:  # frozen: the resolved default is set once, here
            object.__setattr__(self, "block_size", default_block_size(self.kv_cache_dtype))
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError("block_size must be a power of two (or 0: the cache's default)")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.background_prefill_tokens is not None and self.background_prefill_tokens < 1:
            raise ConfigError("background_prefill_tokens must be positive")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"unknown dtype {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
            )
        if self.weight_quant not in ("none", "int4"):
            raise ConfigError(f"weight_quant must be none or int4, got {self.weight_quant!r}")
        if self.backend not in ("auto", "torch", "triton"):
            raise ConfigError(f"unknown backend {self.backend!r}")
        if self.kernels not in ("accepted", "experimental", "none"):
            raise ConfigError(f"kernels must be accepted, experimental or none, got {self.kernels!r}")
        if unknown := sorted(set(self.disabled_kernels) - set(REPLACEABLE)):
            raise ConfigError(f"disabled_kernels names no op: {', '.join(unknown)} (the ops: {', '.join(REPLACEABLE)})")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"unknown device {self.device!r}")
