"""End to end with sharded models (DTensor parameters): FSDP2 on 2 and 4 ranks, tensor parallel on 2,
and a 2x2 data-parallel x tensor-parallel mesh on 4 ranks. Real ranks (gloo, CPU), a real signal to
ONE rank, the rerun compared bitwise with an uninterrupted run (per-step losses and learning rates,
and the final weights loaded back from the checkpoint into an unsharded model)."""

import pytest

from mesh_runs import SCRIPT, final_weights
from resilience import ExitCode
from resilience.checkpoint.storage.manifest import validate
from runs import compare, latest_name, run

pytestmark = pytest.mark.multiproc
STEPS = 30
MESHES = [("fsdp2", 2), ("fsdp2", 4), ("tp", 2), ("dp_tp", 4)]
# The model format is one parameter. DTensor models in `safetensors` (the default) need the sharded
# writer of issue 15 (branch i15-a); until it is merged that variant is expected to fail.
FORMATS = [
    "torch_save",
    pytest.param("safetensors", marks=pytest.mark.xfail(strict=False, reason="needs i15-a: DTensor models in model_save_format: safetensors")),
]


def _run(ckpt_dir, layout, nproc, fmt, **kwargs):
    overrides = [f"layout={layout}", f"steps={STEPS}", f"checkpoint.model_save_format={fmt}"]
    return run(ckpt_dir, nproc, script=SCRIPT, config=SCRIPT, overrides=overrides, timeout=150.0, **kwargs)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """One uninterrupted run per mesh, made on first use and shared by both formats (the final
    weights are compared after loading, whatever the format)."""
    made = {}

    def reference(layout, nproc):
        if (layout, nproc) not in made:
            path = tmp_path_factory.mktemp(f"reference-{layout}-{nproc}")
            assert _run(path, layout, nproc, "torch_save").codes == [ExitCode.DONE] * nproc
            made[layout, nproc] = path
        return made[layout, nproc]

    return reference


@pytest.mark.timeout(420)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("layout,nproc", MESHES, ids=[f"{layout}-{nproc}ranks" for layout, nproc in MESHES])
def test_sharded_run_stopped_through_one_rank_saves_one_step_on_every_rank_and_resumes_bitwise(tmp_path, references, layout, nproc, fmt):
    reference = references(layout, nproc)
    first = _run(tmp_path, layout, nproc, fmt, signal_rank=nproc - 1, signal_at_step=8)
    assert first.codes == [ExitCode.PREEMPTED] * nproc, "every rank exits 75"
    manifest = validate(tmp_path / latest_name(tmp_path))
    stop_step = manifest["meta"]["global_step"]
    assert 8 <= stop_step < STEPS and manifest["meta"]["reason"] == "preemption"
    # one checkpoint of that one step holds every rank's part: optimizer shard, RNG, data position
    for r in range(nproc):
        assert {f"optim/__{r}_0.distcp", f"rng/rank_{r:05d}.safetensors", f"dataloader/rank_{r:05d}.json"} <= set(manifest["files"]), r

    second = _run(tmp_path, layout, nproc, fmt)
    assert second.codes == [ExitCode.DONE] * nproc
    result = compare(tmp_path, reference, weights=final_weights)
    assert result.identical, result.detail
    assert result.steps == STEPS
