"""``make demo`` (second part): a tiny Llama sharded with FSDP2 over 2 ranks (``resilience run
--nproc-per-node 2``), preempted mid-run by
a signal to ONE rank, resumed, compared bitwise with an uninterrupted run, then exported as a
Hugging Face bundle that ``from_pretrained`` loads and generates from: the bundle the final save
built from the ranks' safetensors shards (``checkpoint.save_consolidated: final``, the default).

    python examples/llm/demo.py [dotted overrides for every run, e.g. checkpoint.is_async=true]

Exits 0 only when both ranks saved the same step with the preempted exit code, the resumed run
finished, per-step losses, learning rates and final weights are identical, and the bundle loads
with the trained weights.
"""

from __future__ import annotations

import shutil
import signal
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "digits"))  # the digits demo's runner: launch, signal one rank, compare

import torch  # noqa: E402

from bundle import CONFIG, TRAIN, export_bundle, final_weights, generate  # noqa: E402
from resilience import ExitCode  # noqa: E402
from runs import compare, latest_name, run_cli  # noqa: E402

ROOT = HERE.parents[1] / "runs" / "demo-llm"
SIGNAL_AT_STEP = 12  # of llm.yaml's 24


def main(argv: list[str]) -> int:
    overrides = list(argv)
    shutil.rmtree(ROOT, ignore_errors=True)
    preempted, reference = ROOT / "preempted", ROOT / "reference"
    llm = {"script": TRAIN, "config": CONFIG, "overrides": ["device=cpu", *overrides]}
    ok = True

    print("1. resilience run --nproc-per-node 2 examples/llm/train.py: a tiny Llama, FSDP2 over 2 ranks;", flush=True)
    print("   SIGUSR1 goes to rank 1 only, mid-run", flush=True)
    first = run_cli(preempted, 2, signal_rank=1, signal_at_step=SIGNAL_AT_STEP, sig=signal.SIGUSR1, **llm)
    print(f"   signal sent once rank 0 had logged step {first.signalled_at_step}; exit codes per rank: {first.codes}; saved: {latest_name(preempted)}")
    if first.codes != [ExitCode.PREEMPTED] * 2:
        print(f"   FAIL: expected both ranks to exit {int(ExitCode.PREEMPTED)} (PREEMPTED)")
        print("RESULT: NOT identical (the preempted run did not save and exit 75)")
        return 1

    print("2. the same command again: resumes from LATEST and finishes", flush=True)
    second = run_cli(preempted, 2, **llm)
    print(f"   exit codes per rank: {second.codes}; final checkpoint: {latest_name(preempted)}")
    ok &= second.codes == [ExitCode.DONE] * 2

    print("3. an uninterrupted reference run", flush=True)
    ref = run_cli(reference, 2, **llm)
    print(f"   exit codes per rank: {ref.codes}")
    ok &= ref.codes == [ExitCode.DONE] * 2

    result = compare(preempted, reference, weights=final_weights) if ok else None
    print("4. preempted+resumed vs uninterrupted, compared bitwise:")
    if result is not None:
        print(f"   per-step losses ({result.steps} steps): {'identical' if result.losses_equal else 'DIFFERENT'}")
        print(f"   learning rates:               {'identical' if result.lrs_equal else 'DIFFERENT'}")
        print(f"   final weights (all shards):   {'identical' if result.weights_equal else 'DIFFERENT'}")
        if result.detail:
            print(f"   {result.detail}")
        ok &= result.identical
    print("RESULT:", "identical" if ok else "NOT identical (see above)", flush=True)
    if not ok:
        return 1

    print("5. Hugging Face bundle of the final checkpoint, loaded with AutoModelForCausalLM.from_pretrained", flush=True)
    try:
        bundle, how = export_bundle(preempted)
    except ValueError as exc:  # a torch_save (DCP) model: no bundle
        print(f"   FAIL: {exc}")
        return 1
    text, model = generate(bundle, "import os\n", 24)
    trained = final_weights(preempted)
    loaded = model.state_dict()
    equal = trained.keys() <= loaded.keys() and all(torch.equal(trained[k], loaded[k]) for k in trained)
    print(f"   bundle: {bundle.relative_to(HERE.parents[1])} ({how})")
    print(f"   weights equal to the trained ones: {'yes' if equal else 'NO'}")
    print(f"   greedy continuation of 'import os\\n': {text!r}")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
