"""`astraflow-launch` — render and submit the Slurm job (the Slurm launch issue builds it).

Until then it says so and exits non-zero, rather than pretending to submit anything.
"""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    print("astraflow-launch: the Slurm launcher is not built yet; use `astraflow dataflow` "
          "on one machine for now", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
