"""The batch-1 latency benchmark's TTFT after a cached prefix (kernellab.bench.latency.engine_ttft)."""

from __future__ import annotations

from kernellab.bench.latency import engine_ttft
from kernellab.runtime.engine import LLMEngine


def test_ttft_with_a_shared_prefix_times_requests_whose_prefix_the_cache_holds(tiny_checkpoints):
    eng = LLMEngine(
        model=str(tiny_checkpoints["qwen3"]), device="cpu", dtype="float32", num_kv_blocks=64, max_model_len=256
    )
    prefix = list(range(10, 74))  # 64 tokens: four full blocks of 16
    times = engine_ttft(eng, 8, reps=3, prefix=prefix)
    assert len(times) == 3 and all(t > 0 for t in times)
    stats = eng.stats()
    # the first warm-up fills the cache; the second warm-up and the three timed requests hit all four blocks
    assert stats.prefix_cache_hits == 4 * len(prefix)
    assert stats.prompt_tokens == len(prefix) + 8 + 4 * 8  # every later request computed only its own tokens


def test_ttft_requests_run_with_the_cycle_collector_off_and_restore_it(tiny_checkpoints, monkeypatch):
    """A collection landing inside a ~6 ms request is not the engine's time (the serving worker freezes its
    heap); the collector is back on after each request, and stays off if the caller had it off."""
    import gc

    eng = LLMEngine(
        model=str(tiny_checkpoints["qwen3"]), device="cpu", dtype="float32", num_kv_blocks=64, max_model_len=256
    )
    seen = []
    step = eng.step

    def recording_step():
        seen.append(gc.isenabled())
        return step()

    monkeypatch.setattr(eng, "step", recording_step)
    assert gc.isenabled()
    times = engine_ttft(eng, 8, reps=2)
    assert len(times) == 2 and seen and not any(seen)
    assert gc.isenabled()
    gc.disable()
    try:
        engine_ttft(eng, 8, reps=1)
        assert not gc.isenabled()
    finally:
        gc.enable()
