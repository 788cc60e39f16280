"""Generate docs/kernels.md from the kernel modules' docstrings and the committed GPU artifacts.

    python benchmarks/kernels/make_docs.py [results/kernels/kernels_h200.json] [-o docs/kernels.md]

Numbers come only from the artifact; prose comes from the module docstrings (what each kernel teaches) and
from ``ANALYSIS`` below (what limits a kernel that misses its target), which cites the measured figures.
"""

from __future__ import annotations

import argparse
import ast
import json
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# (module, title) in reading order: the chapters of the lab.
CHAPTERS = [
    ("vector_add", "Vector add and add + SiLU"),
    ("rms_norm", "RMSNorm and fused residual-add + RMSNorm"),
    ("rope", "RoPE, QK-norm + RoPE, fused with the paged KV write"),
    ("kv_cache", "Paged KV-cache write"),
    ("swiglu", "SwiGLU"),
    ("softmax", "Softmax"),
    ("gemv", "Decode GEMV"),
    ("quant_gemv", "W8A16 / W4A16 decode GEMV (experimental)"),
    ("gemm", "Shape-bucketed GEMM"),
    ("attention", "Tiled causal prefill attention"),
    ("paged_attention", "Split-KV paged decode attention"),
    ("argmax", "Argmax and top-k"),
]

# What limits each chapter, written against the measured numbers (update together with the artifact).
ANALYSIS: dict[str, str] = {}


def docstring(module: str) -> str:
    tree = ast.parse((REPO / "kernels" / f"{module}.py").read_text())
    return ast.get_docstring(tree) or ""


def render_docstring(doc: str) -> str:
    """First line as the lead; unindented lines as bold headings; their indented bodies as paragraphs."""
    lines = doc.splitlines()
    out = [lines[0], ""] if lines else []
    heading, body = None, []

    def flush():
        if heading is not None:
            text = textwrap.dedent("\n".join(body)).strip()
            items = [p for p in text.split("\n- ")]
            para = items[0].replace("\n", " ")
            out.append(f"**{heading}.** {para}")
            for item in items[1:]:
                out.append(f"- {item.replace(chr(10), ' ')}")
            out.append("")

    for line in lines[1:]:
        if line and not line.startswith(" "):
            flush()
            heading, body = line.strip().rstrip(":"), []
        elif heading is not None:
            body.append(line)
    flush()
    return "\n".join(out)


def fmt(v, spec="{:.1f}") -> str:
    return "–" if v is None else spec.format(v)


def rate(r: dict) -> str:
    if r.get("gbps") is not None:
        return f"{r['gbps']:.0f} GB/s"
    if r.get("tflops") is not None:
        return f"{r['tflops']:.1f} TFLOP/s"
    return "–"


def target_cell(r: dict) -> str:
    if r.get("target_pct") is None:
        return ""
    return f"{'met' if r.get('meets_target') else '**missed**'} (≥ {r['target_pct']:.0f} %)"


def vs(r: dict, key: str) -> str:
    v = r.get(key)
    return "–" if v is None else f"{v:.2f}×"


def results_table(rows: list[dict]) -> list[str]:
    out = ["| kernel | shape | dtype | time (µs) | rate | % of ceiling | target | torch eager (µs) | "
           "torch.compile (µs) | speedup vs eager / compile | correct (max abs err) |",
           "|---|---|---|---:|---:|---:|---|---:|---:|---|---|"]
    for r in rows:
        err = r.get("max_abs_err")
        err_s = "" if err is None else f" ({err:.2g})"
        out.append(
            f"| `{r['kernel']}` | {r['shape']} | {r['dtype']} | {fmt(r.get('time_us'), '{:.2f}')} | {rate(r)} | "
            f"{fmt(r.get('pct_of_ceiling'))} | {target_cell(r)} | {fmt(r.get('torch_eager_us'), '{:.2f}')} | "
            f"{fmt(r.get('torch_compile_us'), '{:.2f}')} | {vs(r, 'speedup_vs_eager')} / "
            f"{vs(r, 'speedup_vs_compile')} | {'yes' if r.get('correct') else '**no**'}{err_s} |")
    return out


def sweep_table(rows: list[dict]) -> list[str]:
    out = ["| kernel | shape | variant | time (µs) | rate | % of ceiling | correct |",
           "|---|---|---|---:|---:|---:|---|"]
    for r in sorted(rows, key=lambda r: (r["kernel"], r["shape"], r.get("time_us") or 1e30)):
        out.append(f"| `{r['kernel']}` | {r['shape']} | `{r['variant']}` | {fmt(r.get('time_us'), '{:.2f}')} | {rate(r)} | "
                   f"{fmt(r.get('pct_of_ceiling'))} | {'yes' if r.get('correct') else '**no**'} |")
    return out


def verdict(rows: list[dict]) -> list[str]:
    """Faster than the PyTorch reference at the real shape, or a teaching kernel that loses."""
    out = []
    for r in rows:
        best_ref = min([v for v in (r.get("torch_eager_us"), r.get("torch_compile_us")) if v], default=None)
        if best_ref is None or r.get("time_us") is None:
            continue
        wins = r["time_us"] < best_ref
        tag = "faster than" if wins else ("a teaching kernel that loses to" if r.get("teaching") else "slower than")
        out.append(f"- `{r['kernel']}` {r['shape']}: {r['time_us']:.2f} µs, {tag} the best PyTorch reference "
                   f"({best_ref:.2f} µs).")
    return out


def generate(artifact: Path) -> str:
    doc = json.loads(artifact.read_text())
    prov, ceil, results = doc["provenance"], doc["ceilings"], doc["results"]
    tests = doc.get("gpu_tests", {})
    lines = [
        "# Kernel lab",
        "",
        "<!-- generated by benchmarks/kernels/make_docs.py from "
        f"{artifact.relative_to(REPO) if artifact.is_relative_to(REPO) else artifact.name}; do not edit -->",
        "",
        "Triton kernels for the serving runtime, one module per kernel under `kernels/` (import path "
        "`kernellab.kernels`), each mirroring a torch reference in `runtime/ops.py` (same name, same "
        "signature; `kernellab.kernels.KERNELS` maps op name → kernel). Each chapter below says what the kernel "
        "teaches (from its docstring) and what it measured on the GPU.",
        "",
        "## How the numbers are taken",
        "",
        f"- GPU: {prov['gpu']} ({prov.get('sm_count')} SMs); torch {prov['torch']}, Triton {prov['triton']}, "
        f"CUDA {prov['cuda']}, Python {prov['python']}; commit `{prov['commit'][:12]}`, {prov['date']}.",
        f"- Ceilings measured in the same run: device-to-device copy **{fmt(ceil.get('copy_gbps'), '{:.0f}')} GB/s** "
        f"(read + write), read-only reduction **{fmt(ceil.get('read_gbps'), '{:.0f}')} GB/s**, bf16 matmul "
        f"**{fmt(ceil.get('matmul_tflops'), '{:.0f}')} TFLOP/s**. Bandwidth kernels' \"% of ceiling\" is their "
        "GB/s over the read-only bandwidth (as the acceptance criteria ask; a kernel that also writes can reach "
        "the copy figure at best), compute kernels' is TFLOP/s over the matmul.",
        "- Bytes and FLOPs come from an explicit formula per case (each input read once, each output written "
        "once: the minimum traffic), stated in each benchmark module under `benchmarks/kernels/`.",
        "- Time per call = CUDA-graph replay of many back-to-back calls / calls (launch gaps included, Python "
        "overhead excluded), median of 5 replays; inputs rotate over ≥ 256 MB of independent sets so the "
        "60 MB L2 cannot serve them. References that sync the host (boolean-mask indexing, `.max()` on the "
        "device) are timed on a stream instead (`method` in the artifact).",
        "- PyTorch eager and `torch.compile` (default mode) of the same reference run on the same inputs in the "
        "same process. Correctness compares the Triton output with the eager reference on fresh random data.",
        f"- GPU tests (`tests/gpu/test_kernels_gpu.py`): **{tests.get('summary', 'not run')}**.",
        "",
        "Reproduce on a GPU machine: `python3 tests/gpu/run_kernels.py --out DIR`, then "
        "`python benchmarks/kernels/make_docs.py DIR/kernels_h200.json`. CPU tests: "
        "`TRITON_INTERPRET=1 python -m pytest tests/unit/kernels -q`.",
        "",
        "## Summary at Qwen3-0.6B shapes",
        "",
    ]
    defaults = [r for r in results if r["variant"] == "default"]
    lines += results_table(defaults)
    lines += ["", "### Against the PyTorch reference", "", *verdict(defaults)]
    for module, title in CHAPTERS:
        rows = [r for r in results if r.get("group") == module]
        lines += ["", f"## {title} — `kernels/{module}.py`", "", render_docstring(docstring(module)).rstrip(), ""]
        if not rows:
            lines.append("_No measurement in this artifact._")
            continue
        d = [r for r in rows if r["variant"] == "default"]
        lines += ["### Measured", "", *results_table(d)]
        sweep = [r for r in rows if r["variant"] != "default"]
        if sweep:
            swept = {(s["kernel"], s["shape"]) for s in sweep}
            lines += ["", "### Sweep", "", *sweep_table(sweep + [r for r in d if (r["kernel"], r["shape"]) in swept])]
        if module in ANALYSIS:
            lines += ["", "### What limits it", "", ANALYSIS[module]]
    return "\n".join(lines).rstrip() + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact", type=Path, nargs="?", default=REPO / "results" / "kernels" / "kernels_h200.json")
    ap.add_argument("-o", "--out", type=Path, default=REPO / "docs" / "kernels.md")
    args = ap.parse_args()
    args.out.write_text(generate(args.artifact.resolve()))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
