"""``python -m kernellab.services.worker``: the worker configured from KERNELLAB_* environment variables."""

from kernellab.services.config import WorkerSettings
from kernellab.services.worker.main import serve

serve(WorkerSettings())
