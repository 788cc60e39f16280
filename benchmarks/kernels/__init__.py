"""Triton kernel benchmarks: ``harness`` (ceilings, CUDA-graph timing, the artifact, the table), one ``bench_<op>``
module per kernel, ``run_all`` (every case in one process), ``make_docs`` (docs/kernels.md from the artifact).

Run them as modules from the repository root with kernellab installed (``python -m benchmarks.kernels.run_all
--smoke``, ``python -m benchmarks.kernels.bench_gemv``). On the GPU machine, where nothing is installed,
``bash benchmarks/gpu/kernels.sh "$OUT"`` puts the package (tests/gpu/shim.sh) and the repository root on
PYTHONPATH and runs the GPU kernel tests and every benchmark (tests/gpu/run_kernels.py).
"""
