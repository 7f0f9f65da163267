"""Shared by the CLI tests: what a parser leaves undocumented."""

from __future__ import annotations

import argparse


def undocumented(parser) -> list[str]:
    """Subcommands without a description and arguments without help text, walked through the subparsers."""
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                missing += [f"{name}: no description"] * (not sub.description)
                missing += [f"{name} {m}" for m in undocumented(sub)]
        elif not action.help and not isinstance(action, argparse._HelpAction):
            missing.append("/".join(action.option_strings) or action.dest)
    return missing
