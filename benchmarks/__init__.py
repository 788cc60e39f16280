"""Benchmarks: the runnable scripts, never installed. What they share (workloads, stream clients, the synthetic
checkpoint, step-trace timelines, and the code behind the ``kernellab bench`` commands) is library code in the
installed package ``kernellab.bench``, so the CLI, the scripts and tests/gpu import one copy.

- ``benchmarks/*.py``: end-to-end benchmarks (``python benchmarks/<name>.py --help``), each writing a JSON
  artifact with provenance (schemas in kernellab/schemas); ``make_readme_tables.py`` and
  ``update_kernel_status.py`` turn artifacts into the README's and the docs' tables.
- ``benchmarks/kernels/``: the Triton kernel benchmarks, run as modules (``python -m benchmarks.kernels.run_all``).
- ``benchmarks/gpu/``: shell wrappers that run them on the GPU machine, where nothing is installed.

A package so that ``benchmarks.kernels`` imports by name, without ``sys.path`` edits.
"""
