"""``hybridllm doctor``: measure this machine and check the OS settings (the checks live in ``hybridllm.doctor``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from hybridllm.errors import ConfigError


def doctor(
    model: Annotated[Optional[Path], typer.Option("--model", "-m", help="Model whose file read speed (and size) to check (default: the embedded model).")] = None,
    threads: Annotated[Optional[int], typer.Option("--threads", "-t", help="CPU threads for the measurements.")] = None,
    quick: Annotated[bool, typer.Option("--quick", help="Smaller, faster measurements.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Measure this machine (bandwidths, FLOP rate, disk) and check the OS settings that hurt hybrid inference."""
    from hybridllm.doctor import diagnose, print_report

    if threads is not None and threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {threads}")
    report = diagnose(model, threads, quick)
    if as_json:
        typer.echo(json.dumps(report))
    else:
        print_report(report)
