"""The ``te-serial`` command line."""

from __future__ import annotations

import argparse
import sys

from .errors import TeSerialError


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="te-serial",
        description="Pickle-free checkpoints for Transformer Engine quantized tensors.",
        epilog="example:\n  te-serial demo        quantize sample tensors with every recipe",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="quantize a few tensors with every recipe; print sizes and errors")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    try:
        if args.command == "demo":
            from .demo import run_demo
            return run_demo()
    except TeSerialError as e:
        print(f"te-serial: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
