"""``make demo``: a 2-rank run preempted mid-epoch by a signal to ONE rank, resumed, and compared
bitwise with an uninterrupted run.

Exits 0 only when both ranks saved the same step with the preempted exit code, the resumed run
finished, and per-step losses, learning rates and final weights are identical.
"""

from __future__ import annotations

import shutil
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from resilience import ExitCode  # noqa: E402
from runs import compare, latest_name, run  # noqa: E402

ROOT = Path(__file__).resolve().parents[2] / "runs" / "demo"


def main() -> int:
    shutil.rmtree(ROOT, ignore_errors=True)
    preempted, reference = ROOT / "preempted", ROOT / "reference"
    ok = True

    print("1. 2-rank run; SIGUSR1 goes to rank 1 only, mid-epoch", flush=True)
    first = run(preempted, 2, signal_rank=1, signal_at_step=30, sig=signal.SIGUSR1)
    saved = latest_name(preempted)
    print(
        f"   signal sent once rank 0 had logged step {first.signalled_at_step} (its log trails the ranks by a step or two); "
        f"exit codes per rank: {first.codes}; saved: {saved}"
    )
    if first.codes != [ExitCode.PREEMPTED] * 2:
        print(f"   FAIL: expected both ranks to exit {int(ExitCode.PREEMPTED)} (PREEMPTED)")
        ok = False

    print("2. the same command again: resumes from LATEST and finishes", flush=True)
    second = run(preempted, 2)
    print(f"   exit codes per rank: {second.codes}; final checkpoint: {latest_name(preempted)}")
    ok &= second.codes == [ExitCode.DONE] * 2

    print("3. an uninterrupted reference run", flush=True)
    ref = run(reference, 2)
    print(f"   exit codes per rank: {ref.codes}")
    ok &= ref.codes == [ExitCode.DONE] * 2

    result = compare(preempted, reference)
    print("4. preempted+resumed vs uninterrupted, compared bitwise:")
    print(f"   per-step losses ({result.steps} steps): {'identical' if result.losses_equal else 'DIFFERENT'}")
    print(f"   learning rates:               {'identical' if result.lrs_equal else 'DIFFERENT'}")
    print(f"   final weights:                {'identical' if result.weights_equal else 'DIFFERENT'}")
    if result.detail:
        print(f"   {result.detail}")
    ok &= result.identical
    print("RESULT:", "identical" if ok else "NOT identical (see above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
