"""Server-side choices that shape every request (``ServingOptions``): sampling defaults from the model's
generation_config.json (unless turned off), default chat-template switches, and which output parsers run. The
gateway builds them from its settings; front ends without their own (the batch runner, the RunPod handler) take
``default_options``."""

from __future__ import annotations

from dataclasses import dataclass, field

# The model's generation_config.json fields that are request sampling defaults, as the peers apply them.
_GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class ServingOptions:
    """Server-side choices that shape every request: sampling defaults (the model's generation_config.json
    unless turned off), default template switches, and which output parsers run."""

    sampling_defaults: dict = field(default_factory=dict)
    default_max_tokens: int | None = None  # generation_config's max_new_tokens; None: the rest of the context
    chat_template_kwargs: dict = field(default_factory=dict)
    reasoning: bool = False  # split <think> blocks into the reasoning field
    tools: bool = True  # parse <tool_call> blocks into tool_calls
    think_end_id: int | None = None

    @classmethod
    def build(
        cls,
        tokenizer,
        *,
        generation_config: str = "auto",
        chat_template_kwargs: dict | None = None,
        reasoning_parser: str = "auto",
        tool_parser: str = "auto",
    ) -> ServingOptions:
        gen = getattr(tokenizer, "generation_config", None) or {} if generation_config == "auto" else {}
        defaults = {
            k: gen[k]
            for k in _GENERATION_DEFAULTS
            if isinstance(gen.get(k), int | float) and not isinstance(gen.get(k), bool)
        }
        if not gen.get("do_sample", True):  # greedy by the model's own choice
            defaults = {"temperature": 0.0}
        max_new = gen.get("max_new_tokens")
        template = getattr(tokenizer, "chat_template", None) or ""
        reasoning = reasoning_parser == "qwen3" or (reasoning_parser == "auto" and "<think>" in template)
        think_end = tokenizer.token_id("</think>") if reasoning and hasattr(tokenizer, "token_id") else None
        return cls(
            defaults,
            max_new if isinstance(max_new, int) and max_new > 0 else None,
            dict(chat_template_kwargs or {}),
            reasoning,
            tool_parser != "none",
            think_end,
        )


_DEFAULT_OPTIONS: dict[int, ServingOptions] = {}


def default_options(tokenizer) -> ServingOptions:
    """The options the process's settings (KERNELLAB_* environment) give, for front ends without their own
    (the batch runner, the RunPod handler); cached per tokenizer."""
    opts = _DEFAULT_OPTIONS.get(id(tokenizer))
    if opts is None:
        from kernellab.services.config import StackSettings

        opts = _DEFAULT_OPTIONS[id(tokenizer)] = StackSettings().serving_options(tokenizer)
    return opts
