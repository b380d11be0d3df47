"""The ``kvtier`` command: ``serve``, ``stats`` and ``bench …``.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``run(args)``;
modules are found by name so that nothing here imports ``kvtier.bench`` (benchmarks may import
everything, nothing imports them). Only the module of the subcommand named is imported: the
benchmarks import torch, which ``kvtier serve`` must not load (1.4 s of its start, 190 MB), and
which a daemon-only install lacks: a benchmark named there says so instead of a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

COMMANDS = {
    "serve": ("kvtier.service.serve", "run the daemon (embedded defaults need no flags)"),
    "stats": ("kvtier.service.stats.cli", "hits per tier from a running daemon"),
}
BENCHMARKS = {
    "tiers": ("kvtier.bench.tiers", "host and disk tier throughput beside memcpy and raw disk"),
    "daemon": ("kvtier.bench.daemon.command", "daemon lookup latency and arena copy rates"),
    "replay": ("kvtier.bench.replay.command", "replay a request trace through the tier stack"),
    "gpu": ("kvtier.bench.gpu.command", "PCIe ceiling, copy ratios and TTFT on a CUDA machine"),
    "remote": ("kvtier.bench.remote", "remote tier put/get beside raw pipelined SET/GET"),
    "serve": ("kvtier.bench.serve.command", "a timed trace served with and without kvtier"),
    "gate": ("kvtier.bench.gate.command", "TTFT of a disk hit, slow disk or fast, gate on or off"),
}


def _add(
    subparsers: argparse._SubParsersAction, name: str, module: str, help_text: str, named: bool
) -> None:
    parser = subparsers.add_parser(name, help=help_text, description=help_text)
    parser.set_defaults(_module=module)
    if not named:  # only its own arguments are ever parsed
        return
    try:
        subcommand = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != "torch":
            raise
        parser.exit(
            2,
            f"{parser.prog} needs torch, which is not installed here: "
            "pip install 'kvtier[torch]' (or any torch >= 2.4 build of your own)\n",
        )
    subcommand.add_arguments(parser)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The parser for ``argv``: every subcommand listed, the arguments of those it names."""
    words = [word for word in argv if not word.startswith("-")][:2]
    command = words[0] if words else ""
    benchmark = words[1] if command == "bench" and len(words) > 1 else ""
    parser = argparse.ArgumentParser(prog="kvtier", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        _add(commands, name, module, help_text, name == command)
    bench = commands.add_parser("bench", help="benchmarks that print ratios to physical limits")
    benches = bench.add_subparsers(dest="benchmark", required=True)
    for name, (module, help_text) in BENCHMARKS.items():
        _add(benches, name, module, help_text, name == benchmark)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
