"""kernellab: an OpenAI-compatible LLM serving stack built around its own Triton kernels.

Subpackages map the repository's top-level folders: ``kernellab.runtime`` (engine), ``kernellab.kernels``
(Triton kernels), ``kernellab.services`` (gateway, queue, worker, batch, load generation, CLI).
"""

__version__ = "0.1.0"
