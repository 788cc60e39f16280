"""Benchmark workloads, generated the same way in every run (seeded)."""

from __future__ import annotations

import random

CHAT_QUESTIONS = [
    "What is the capital of France?",
    "Explain what a hash table is.",
    "Write a haiku about the ocean.",
    "List three uses of copper.",
    "Why is the sky blue?",
    "Give me a tip for learning to cook.",
    "What does a CPU do?",
    "Describe a cat in one sentence.",
    "How do vaccines work?",
    "What is 12 times 12?",
    "Suggest a name for a bakery.",
    "What is photosynthesis?",
    "Translate 'good morning' into Spanish.",
    "How many legs does a spider have?",
    "What is the boiling point of water?",
    "Tell me a fact about octopuses.",
    "How does a bicycle stay upright?",
    "What is a prime number?",
    "Summarise the water cycle.",
    "Why do we have seasons?",
    "What is machine learning?",
    "Name three planets.",
    "How do bees make honey?",
    "What is the speed of light?",
    "Describe a rainbow.",
    "How does a refrigerator work?",
    "What is an API?",
    "Give a synonym for happy.",
    "Why is exercise healthy?",
    "What is a volcano?",
    "How do airplanes fly?",
    "What is the tallest mountain?",
]


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    """n chat-templated prompts (the questions cycle, numbered so each prompt is distinct)."""
    out = []
    for i in range(n):
        q = CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)]
        text = q if i < len(CHAT_QUESTIONS) else f"({i}) {q}"
        out.append(tokenizer.apply_chat_template([{"role": "user", "content": text}]))
    return out


def nanovllm(num_seqs: int = 256, min_len: int = 100, max_len: int = 1024, vocab: int = 10000, seed: int = 0):
    """nano-vllm's benchmark: random prompts first, then random output lengths (EOS ignored)."""
    random.seed(seed)
    prompts = [[random.randint(0, vocab) for _ in range(random.randint(min_len, max_len))] for _ in range(num_seqs)]
    outputs = [random.randint(min_len, max_len) for _ in range(num_seqs)]
    return prompts, outputs
