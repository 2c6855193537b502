"""The ``hybridllm`` command: the typer app and its commands, one module each.

Errors caused by the user's input print one line (``error: ...``) and exit with code 2. The
options that several commands share are declared once, in :mod:`hybridllm.cli.options`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import typer

from hybridllm.cli.bench import bench
from hybridllm.cli.doctor import doctor
from hybridllm.cli.eval import lm_eval, perplexity
from hybridllm.cli.chat import chat
from hybridllm.cli.generate import generate
from hybridllm.cli.models import models
from hybridllm.cli.plan import plan
from hybridllm.cli.quantize import quantize
from hybridllm.cli.serve import serve
from hybridllm.errors import HybridLLMError

EXIT_USAGE = 2


def fail(message: str) -> None:
    """Print a one-line error and exit with code 2."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(EXIT_USAGE)


def cli_errors(func: Callable[..., Any]) -> Callable[..., Any]:
    """Turn user-facing errors into one line and exit code 2 (no traceback)."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except HybridLLMError as exc:
            fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        except KeyboardInterrupt:
            typer.echo("interrupted", err=True)
            raise typer.Exit(130) from None

    return wrapper


app = typer.Typer(
    name="hybridllm",
    help="Local LLM inference that splits work between host (CPU/RAM) and device (GPU/VRAM), and measures it.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _print_version(value: bool) -> None:
    if value:
        from hybridllm import __version__

        typer.echo(f"hybridllm {__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """Local LLM inference that splits work between host (CPU/RAM) and device (GPU/VRAM), and measures it."""


eval_app = typer.Typer(help="Quality evaluations against the float reference of the same model.", no_args_is_help=True)

for command in (generate, chat, serve, bench, plan, doctor, quantize, models):
    app.command(name=command.__name__)(cli_errors(command))
eval_app.command(name="perplexity")(cli_errors(perplexity))
eval_app.command(name="lm-eval")(cli_errors(lm_eval))
app.add_typer(eval_app, name="eval")


def main() -> None:
    """Console-script entry point."""
    app()
