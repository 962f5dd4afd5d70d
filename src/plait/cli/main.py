"""Entry point of the ``plait`` command: builds the Typer app from one module per sub-command."""

from __future__ import annotations

import importlib

import typer

from plait.cli.help import readable

EPILOG = """Each command's --help says what it does, its defaults, and examples.

\b
Examples:
  plait demo                   # a two-minute tour on this host's CPUs
  plait train --steps 50       # a tiny model on this host: a first real run
  plait plan --model llama3-70b --gpus 64 --gpu h100-sxm
  plait simulate --schedule 1f1b --stages 4 --microbatches 8
"""

app = typer.Typer(
    name="plait",
    help="Plan, simulate, run and verify tensor, sequence, pipeline, data and expert parallelism.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"max_content_width": 110},
    rich_markup_mode=None,  # click formatting: paragraphs re-flow to the terminal, \b blocks stay as written
    epilog=EPILOG,
)


def _version(value: bool) -> None:
    if value:
        from plait import __version__

        typer.echo(f"plait {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """Plan, simulate, run and verify tensor, sequence, pipeline, data and expert parallelism."""


# One module per sub-command, each defining ``register(app)``; heavy imports (torch) happen inside the commands.
COMMAND_MODULES = [
    "plait.cli.simulate",
    "plait.cli.plan",
    "plait.cli.topo",
    "plait.cli.calibrate",
    "plait.cli.verify",
    "plait.cli.train",
    "plait.cli.generate",
    "plait.cli.export",
    "plait.cli.serve",
    "plait.cli.demo",
    "plait.cli.data",
]

for _name in COMMAND_MODULES:
    importlib.import_module(_name).register(app)
readable(app)  # --help names values as they are typed (INT, FILE), not as Python types


def main() -> None:
    app()


if __name__ == "__main__":
    main()
