"""``zerotune``: a click group; each subcommand lives in its own module."""

from __future__ import annotations

import click

from .env import env
from .estimate import estimate
from .export import export
from .finetune import finetune


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="zerotune")
def main() -> None:
    """zerotune: fully fine-tune Hugging Face models with ZeRO-3 and ZeRO-Infinity offload."""


main.add_command(env)
main.add_command(estimate)
main.add_command(export)
main.add_command(finetune)
