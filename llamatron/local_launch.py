"""torchrun for `--nproc-per-node N`, reporting a failed job in one line.

The ranks already say what went wrong (a configuration or data error, once). torchrun would follow that with
its own traceback and failure table; here a failure ends with one line naming the ranks and their exit codes,
and the job exits with the first failed rank's code (2 for a bad setting, as a single process would).
Run as `python -m llamatron.local_launch TORCHRUN_ARGS...`.
"""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run


def main(argv: list[str] | None = None) -> int:
    try:
        run(parse_args(sys.argv[1:] if argv is None else argv))
    except ChildFailedError as e:
        # Ranks ended by a signal were mostly stopped by torchrun after another rank failed.
        said = "; ".join(f"rank {r}: " + (f"exit code {f.exitcode}" if f.exitcode >= 0 else
                                          f"stopped by {f.signal_name()}") for r, f in sorted(e.failures.items()))
        print(f"llamatron: the job failed ({said}); the failing rank's message is above", file=sys.stderr,
              flush=True)
        return next((f.exitcode for _, f in sorted(e.failures.items()) if f.exitcode > 0), 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
