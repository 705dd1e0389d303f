"""The ``mamba2-cutile`` command (also ``python3 -m properties``): check, repro, envelope, bench,
ab.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``main(args) -> int``;
only the chosen one is imported, so a missing or broken module breaks only its own subcommand.
"""
from __future__ import annotations

import argparse
import importlib
import sys
import traceback
from typing import Optional

COMMANDS = {
    "check": ("properties.check",
              "build one problem, run every implementation available here and every oracle tier "
              "that fits, and print each one's errors against the highest tier"),
    "repro": ("properties.repro",
              "replay a failure artifact (or a problem given by options) and name the first stage "
              "where the error appears"),
    "envelope": ("properties.envelope",
                 "measure (or --check against a recorded one) the error envelope of the kernels"),
    "bench": ("properties.bench", "benchmark the kernels against the references"),
    "ab": ("properties.ab",
           "time the dispatched kernels against named changes of their configs, same inputs, "
           "interleaved rounds"),
}


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="mamba2-cutile", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module_name, summary) in COMMANDS.items():
        command = sub.add_parser(name, help=summary, description=summary)
        if name != chosen:
            continue
        try:
            module = importlib.import_module(module_name)
            module.add_arguments(command)
        except Exception:
            traceback.print_exc()
            print(f"mamba2-cutile {name}: cannot load {module_name} (the traceback above says "
                  "why); the other subcommands are unaffected", file=sys.stderr)
            return 2
        command.set_defaults(run=module.main)
    args = parser.parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
