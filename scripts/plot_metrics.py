"""Plot reward and response-length curves of a run.

    python scripts/plot_metrics.py outputs/my_run/metrics.jsonl [curves.png]

Without an output path the PNG is written as metrics.png next to the jsonl.
"""
import argparse
import sys

from hybridflow.tracking.plot import plot_metrics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("metrics", help="metrics.jsonl written by the jsonl logger")
    parser.add_argument("out", nargs="?", default=None, help="output PNG (default: metrics.png "
                        "next to the jsonl)")
    args = parser.parse_args(argv)
    try:
        out = plot_metrics(args.metrics, args.out)
    except (OSError, ValueError) as e:
        print(f"plot_metrics: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
