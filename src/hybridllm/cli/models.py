"""``hybridllm models``: the models already on this machine (never a download)."""

from __future__ import annotations

import json
from typing import Annotated

import typer


def models(
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON list.")] = False,
) -> None:
    """List the models found in the default model's package and the local Hugging Face cache."""
    from hybridllm.loading.local_models import hf_hub_dir, local_models
    from hybridllm.loading.registry import installed_default_model
    from hybridllm.units import format_bytes

    found = local_models(installed_default_model())
    if as_json:
        typer.echo(json.dumps([model.to_dict() for model in found]))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"models on this machine (Hugging Face cache: {hf_hub_dir()})")
    for column in ("name (--model)", "architecture", "type", "size", "source", "path"):
        table.add_column(column)
    for model in found:
        table.add_row(model.name, model.architecture, model.weight_type, format_bytes(model.size_bytes),
                      model.source, str(model.path))
    Console().print(table)
    if not found:
        typer.echo("no models found; pass a GGUF file or a Hugging Face folder with --model", err=True)
