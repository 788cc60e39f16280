#!/usr/bin/env python3
"""A/B of two source trees of the engine (two commits) on batch-1 latency, interleaved rounds, one GPU.

``knob_ab.py`` compares values of a constant read when graphs are captured; a change to the engine's host path (what
runs between ``add_request`` and the token: validation, scheduling, the graph's input fill, the sampler, the step's
bookkeeping) has no such constant. Here each tree runs in a process of its own, with its own package on the path
(``tests/gpu/shim.sh``), builds the gate's latency engine once, and measures when the driver asks: the rounds
alternate the trees' order (A B, B A, ...), so both meet the same machine state. Measured per round: TTFT of fresh
prompts (median of 10 at each ``--ttft`` length), batch-1 ITL at each ``--contexts``; the greedy tokens of one request
from each tree are compared.

    # the old tree: git archive <commit> kernellab kernels runtime services | tar -x -C .ab/old
    python3 benchmarks/gpu/tree_ab.py --out "$OUT/tree" --trees old=$ROOT/.ab/old,new=$ROOT --ttft 2048,32
    python3 benchmarks/gpu/tree_ab.py --out /tmp/tree --device cpu --trees a=.,b=.   # the path, on a CPU

Random weights of the exact Qwen3-0.6B shape on the GPU; a tiny Qwen3 with torch ops on the CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SUBPACKAGES = {"kernels": "kernels", "runtime": "runtime", "services": "services"}


def shim(root: Path) -> Path:
    """A folder holding ``kernellab/`` whose entries link to ``root``'s folders (tests/gpu/shim.sh's layout)."""
    top = Path(tempfile.mkdtemp(prefix="tree_ab_"))
    pkg = top / "kernellab"
    pkg.mkdir()
    for entry in (root / "kernellab").iterdir():
        (pkg / entry.name).symlink_to(entry.resolve())
    for name, folder in SUBPACKAGES.items():
        if (root / folder).is_dir():
            (pkg / name).symlink_to((root / folder).resolve())
    return top


def tree_commit(root: Path) -> str:
    """The tree's commit: a ``COMMIT`` file (an archive's), else git's HEAD with ``+dirty`` for local changes, else
    ``KERNELLAB_COMMIT`` (the device machine's copy of the working tree has no git)."""
    if (root / "COMMIT").is_file():
        return (root / "COMMIT").read_text().strip()
    if not (root / ".git").exists():
        return os.environ.get("KERNELLAB_COMMIT", "unknown")
    env = {**os.environ, "GIT_DIR": str(root / ".git")}
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], env=env, capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        )
        return sha.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# ---------------------------------------------------------------------------------------------- the tree's process
def serve(device: str, ttft: list[int], contexts: list[int]) -> int:
    """Build the latency engine of the tree on this process's path, then answer the driver's lines on stdin:
    ``measure`` → one JSON row of figures, ``tokens`` → the greedy tokens of a fixed request, ``quit``."""
    import torch

    from kernellab.bench.engine_ab import itl_figures
    from kernellab.bench.latency import engine_ttft
    from kernellab.bench.offline import gate_offline_setup
    from kernellab.runtime.config import EngineConfig
    from kernellab.runtime.engine import LLMEngine
    from kernellab.runtime.request.sampling import SamplingParams

    gpu = device == "cuda"
    cfg, _, _ = gate_offline_setup(device)
    cfg = dict(cfg, max_num_seqs=8, max_model_len=4096 if gpu else 512, num_kv_blocks=2048 if gpu else 256)
    eng = LLMEngine(EngineConfig(**cfg))
    if not gpu:
        eng.runner.eager_windows(8)
    print(json.dumps({"ready": True, "engine": cfg}), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "measure":
            row = itl_figures(eng, contexts, 64 if gpu else 12)
            for n in ttft:
                row[f"ttft_ms_p50@{n}"] = round(statistics.median(engine_ttft(eng, n, reps=10 if gpu else 2)) * 1e3, 4)
            print(json.dumps(row), flush=True)
        elif cmd == "tokens":
            gen = torch.Generator().manual_seed(7)
            prompt = torch.randint(0, 10000, (300,), generator=gen).tolist()
            eng.add_request(
                "check", prompt, SamplingParams(temperature=0.0, max_tokens=96 if gpu else 8, ignore_eos=True)
            )
            out: list[int] = []
            while eng.has_unfinished_requests():
                out += [t for o in eng.step() for t in o.new_token_ids]
            print(json.dumps({"tokens": out}), flush=True)
        elif cmd == "quit":
            break
    return 0


# ---------------------------------------------------------------------------------------------------- the driver
class Tree:
    def __init__(self, name: str, root: Path, args):
        self.name, self.root, self.commit = name, root, tree_commit(root)
        self.path = shim(root)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(self.path), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]
        )
        cmd = [sys.executable, str(Path(__file__).resolve()), "--serve", "--device", args.device]
        cmd += ["--ttft", ",".join(map(str, args.ttft)), "--contexts", ",".join(map(str, args.contexts))]
        # started from a folder without a kernellab/ of its own: the shim's package is the one imported
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=str(self.path)
        )

    def read(self) -> dict:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.strip()
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"tree {self.name}: its process ended (exit {self.proc.wait()})")

    def ask(self, cmd: str) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, RuntimeError, ValueError):
                self.ask("quit")
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self.path, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="")
    ap.add_argument("--trees", default="", help="name=path,name=path: repo roots (or archives of their packages)")
    ap.add_argument("--ttft", default="2048", type=lambda s: [int(v) for v in s.split(",") if v])
    ap.add_argument("--contexts", default="128", type=lambda s: [int(v) for v in s.split(",") if v])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return serve(args.device, args.ttft, args.contexts)
    if not args.out or not args.trees:
        raise SystemExit("--out and --trees are needed")
    from kernellab.bench.engine_ab import median_summary
    from kernellab.results import provenance, write

    if args.device == "cpu":
        args.ttft = [min(n, 256) for n in args.ttft]
        args.contexts = [c for c in args.contexts if c < 400] or [64]
    specs = [spec.split("=", 1) for spec in args.trees.split(",")]
    if len(specs) < 2 or len({n for n, _ in specs}) != len(specs):
        raise SystemExit("--trees needs two or more distinctly named trees")
    t = time.perf_counter()
    trees = [Tree(name, Path(path).resolve(), args) for name, path in specs]
    try:
        engines = {}
        for tree in trees:  # they build at once; measuring waits for all
            ready = tree.read()
            engines[tree.name] = ready["engine"]
        print(f"{len(trees)} engines ready in {time.perf_counter() - t:.1f}s", flush=True)
        runs: list[dict] = []
        for r in range(args.rounds):
            for tree in trees if r % 2 == 0 else trees[::-1]:
                row = {"tree": tree.name, "round": r, **tree.ask("measure")}
                print(json.dumps(row), flush=True)
                runs.append(row)
        tokens = {tree.name: tree.ask("tokens")["tokens"] for tree in trees}
    finally:
        for tree in trees:
            tree.close()
    names = [tree.name for tree in trees]
    same = len({tuple(v) for v in tokens.values()}) == 1
    summary = median_summary(runs, "tree", names)
    print(f"same greedy tokens from every tree: {same}", flush=True)
    result = {
        "schema": "kernellab.bench.tree_ab/v1",
        "provenance": provenance(args.device),
        "trees": {tree.name: tree.commit for tree in trees},
        "engine": engines[names[0]],
        "workload": "TTFT of fresh random prompts at each --ttft length (median of 10, add_request to the token); "
        "batch-1 ITL, 64 greedy tokens after a random prompt of each context; interleaved rounds, one process and "
        "engine per tree",
        "same_tokens": same,
        "runs": runs,
        "summary": summary,
    }
    write(Path(args.out) / "tree_ab.json", result)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
