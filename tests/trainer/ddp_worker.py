"""``openbook train`` as torchrun runs it, except that one rank dies (SIGKILL) or stalls
(SIGSTOP: alive, but never answers a collective again) after a step.

    torchrun ... tests/trainer/ddp_worker.py --kill-rank R --kill-at-step S [--stall] -- train ...

This comes after the step's checkpoint (if one is due), as a crash of that rank would.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import openbook_trainer.loop as loop
from openbook_trainer.__main__ import command_group


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kill-rank", type=int, required=True)
    parser.add_argument("--kill-at-step", type=int, required=True)
    parser.add_argument("--stall", action="store_true", help="SIGSTOP instead of SIGKILL")
    parser.add_argument("argv", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    rank = int(os.environ["RANK"])
    real_train = loop.train

    def killed_at(step: int, loss: float) -> None:
        if rank == args.kill_rank and step == args.kill_at_step:
            os.kill(os.getpid(), signal.SIGSTOP if args.stall else signal.SIGKILL)

    def train(cfg, *, on_step=None, **options):  # type: ignore[no-untyped-def]
        return real_train(cfg, on_step=killed_at, **options)

    loop.train = train
    sys.exit(command_group().main(args=argv, prog_name="openbook-trainer"))


if __name__ == "__main__":
    main()
