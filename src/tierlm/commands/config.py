"""`tierlm config show` (a config's values, files, presets and overrides merged and validated) and `tierlm config list`
(the presets shipped in the package)."""

from __future__ import annotations

import argparse

from tierlm.commands.options import Command, add_config_args


def arguments(parser: argparse.ArgumentParser) -> None:
    tools = parser.add_subparsers(dest="config_command", required=True)
    add_config_args(tools.add_parser("show", help="print the resolved config"), required=False)
    tools.add_parser("list", help="list the presets shipped with tierlm (use one as --config NAME)")


def run(args: argparse.Namespace) -> None:
    from tierlm.config import TierlmConfig
    from tierlm.config.files import list_presets

    if args.config_command == "list":
        presets = list_presets()
        width = max(map(len, presets))
        for name, about in presets.items():
            print(f"{name:<{width}}  {about}")
        return
    print(TierlmConfig.load(args.config, args.overrides).to_yaml(), end="")


COMMAND = Command(arguments, run)
