"""`kernellab` command line (typer + rich). Each group of commands lives in its own module."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="kernellab",
    help="kernellab: an OpenAI-compatible LLM serving stack with its own Triton kernels.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _register() -> None:
    # Imported for their side effect of adding commands to ``app``, in the order `kernellab --help` lists them
    # (hence unsorted); each module imports heavy dependencies (torch, fastapi) inside its command functions so
    # `kernellab --help` stays fast.
    from kernellab.services import cli_runtime, cli_stack, cli_batch, cli_stress  # noqa: F401, I001


_register()

if __name__ == "__main__":  # `python -m kernellab.services.cli`: commands live on the imported module's app
    from kernellab.services.cli import app as registered

    registered()
