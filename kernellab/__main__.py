"""`python -m kernellab …` is the `kernellab` command."""

from kernellab.services.cli import app

app()
