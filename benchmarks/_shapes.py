"""The benchmarks' shape arguments: BATCHxLEN items, and head dims that run only at a few shapes.

A table over every head dim at every shape would take most of a device run, and the acceptance asks
each extra head dim at one shape only (prefill 4 x 4096, decode 64 x 4096), so --more-head-dims names
the dims timed only at the --more-shapes, beside the --head-dims timed at every shape.
"""

from __future__ import annotations

import argparse


def batch_by_length(text: str) -> tuple[int, int]:
    """A BATCHxLEN item with both positive."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(part.isdigit() and int(part) > 0 for part in parts):
        raise argparse.ArgumentTypeError(f"expected BATCHxLEN with positive integers (e.g. 4x4096), got {text!r}")
    return int(parts[0]), int(parts[1])


def add_more_head_dims(parser: argparse.ArgumentParser, choices, default_shape: tuple[int, int]) -> None:
    parser.add_argument("--more-head-dims", nargs="+", type=int, choices=choices, default=[], metavar="D",
                        help="head dims timed only at the --more-shapes (any of " + " ".join(map(str, choices)) + ")")
    batch, length = default_shape
    parser.add_argument("--more-shapes", nargs="+", type=batch_by_length, default=[default_shape], metavar="BxL",
                        help=f"the shapes of the --more-head-dims (default {batch}x{length})")


def head_dim_shapes(head_dims, shapes, more_head_dims, more_shapes) -> list[tuple[int, tuple[int, int]]]:
    """(head dim, shape) in table order: every head dim at every shape, then each more-head-dim (not
    already among head_dims) at the more-shapes."""
    pairs = [(dim, shape) for dim in head_dims for shape in shapes]
    return pairs + [(dim, shape) for dim in more_head_dims if dim not in head_dims for shape in more_shapes]
