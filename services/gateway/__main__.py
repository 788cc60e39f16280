"""``python -m kernellab.services.gateway``: the gateway configured from KERNELLAB_* environment variables."""

from kernellab.services.config import GatewaySettings
from kernellab.services.gateway.main import serve

serve(GatewaySettings())
