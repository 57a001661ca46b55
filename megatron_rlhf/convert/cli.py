"""Shared command-line plumbing of ``tools/convert/*.py`` (argument parser, summary printing).

Each CLI builds its parser with :func:`parser`, adds its own arguments and calls :func:`run` with
a :mod:`megatron_rlhf.convert.pipeline` function; errors that name a tensor or field (bad
architecture, layout, shapes, missing files) exit with status 2 and the message, without a
traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

__all__ = ["parser", "run"]


def parser(description: str) -> argparse.ArgumentParser:
    """An ``ArgumentParser`` with ``--dry-run``, ``--no-progress`` and ``--json``."""
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true",
                   help="validate the input and print the summary without writing anything")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON line")
    return p


def run(fn, args: argparse.Namespace, **kwargs) -> int:
    """Call ``fn(dry_run=..., progress=..., **kwargs)`` and print its
    :class:`~megatron_rlhf.convert.pipeline.ConversionSummary` (table, or JSON with ``--json``).

    Returns:
        0 on success; 2 on ValueError / KeyError / FileNotFoundError / FileExistsError (message
        printed to stderr as ``error: ...``).
    """
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        summary = fn(dry_run=args.dry_run, progress=not args.no_progress, **kwargs)
    except (ValueError, KeyError, FileNotFoundError, FileExistsError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"error: {msg}", file=sys.stderr)
        return 2
    print(json.dumps(summary.to_dict()) if args.json else summary)
    return 0
