"""End to end with sharded models (DTensor parameters): FSDP2 on 2 ranks, tensor parallel on 2,
and a 2x2 data-parallel x tensor-parallel mesh on 4 ranks. Real ranks (gloo, CPU), a real signal to
ONE rank, the rerun compared bitwise with an uninterrupted run (per-step losses and learning rates,
and the final weights loaded back from the checkpoint into an unsharded model)."""

import pytest

from resilience import ExitCode
from resilience.checkpoint.storage.manifest import all_files, validate
from runs import compare, latest_name, run
from sharded_runs import MESH_SCRIPT, mesh_final_weights

pytestmark = pytest.mark.multiproc
STEPS = 20  # StepLR(step_size=7): the LR changes twice; the signal at step 6 lands mid-run
SIGNAL_AT = 6
# Every mesh in the default format (each rank its own safetensors shards); the model as DCP files
# (`torch_save`) once, on the smallest mesh, to keep the suite's time in check. FSDP2 runs on 2
# ranks here: on 4 (a quarter each, resharded to 2 and 1) it is test_sharded_reshard's, and 4 ranks
# cost ~30 s on the 2-core CI machine.
CASES = [("fsdp2", 2, "safetensors"), ("tp", 2, "safetensors"), ("dp_tp", 4, "safetensors"), ("fsdp2", 2, "torch_save")]


def _run(ckpt_dir, layout, nproc, fmt, extra=(), **kwargs):
    overrides = [f"layout={layout}", f"steps={STEPS}", f"checkpoint.model_save_format={fmt}", *extra]
    return run(ckpt_dir, nproc, script=MESH_SCRIPT, config=MESH_SCRIPT, overrides=overrides, timeout=150.0, **kwargs)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """One uninterrupted run per mesh (default format), made on first use and shared by both
    formats (the final weights are compared after loading, whatever the format)."""
    made = {}

    def reference(layout, nproc):
        if (layout, nproc) not in made:
            path = tmp_path_factory.mktemp(f"reference-{layout}-{nproc}")
            assert _run(path, layout, nproc, "safetensors").codes == [ExitCode.DONE] * nproc
            made[layout, nproc] = path
        return made[layout, nproc]

    return reference


@pytest.mark.timeout(420)
@pytest.mark.parametrize("layout,nproc,fmt", CASES, ids=[f"{layout}-{nproc}ranks-{fmt}" for layout, nproc, fmt in CASES])
def test_sharded_run_stopped_through_one_rank_saves_one_step_on_every_rank_and_resumes_bitwise(tmp_path, references, layout, nproc, fmt):
    reference = references(layout, nproc)
    first = _run(tmp_path, layout, nproc, fmt, signal_rank=nproc - 1, signal_at_step=SIGNAL_AT)
    assert first.codes == [ExitCode.PREEMPTED] * nproc, "every rank exits 75"
    manifest = validate(tmp_path / latest_name(tmp_path))
    stop_step = manifest["meta"]["global_step"]
    assert SIGNAL_AT <= stop_step < STEPS and manifest["meta"]["reason"] == "preemption"
    # one checkpoint of that one step holds every rank's part: optimizer shard, RNG, data position
    files = all_files(tmp_path / latest_name(tmp_path), manifest)  # each rank's own, in its rank manifest
    for r in range(nproc):
        assert f"rank_state/rank_{r:05d}.safetensors" in files, r
        assert any(name.startswith(f"optim/shard-{r + 1:05d}-model-") for name in files), (r, "its optimizer pieces")
        if fmt == "safetensors":  # and its own model shards (NeMo's names), written by that rank
            assert any(name.startswith(f"model/shard-{r + 1:05d}-model-") for name in files), (r, sorted(files))

    second = _run(tmp_path, layout, nproc, fmt)
    assert second.codes == [ExitCode.DONE] * nproc
    result = compare(tmp_path, reference, weights=mesh_final_weights)
    assert result.identical, result.detail
    assert result.steps == STEPS


@pytest.mark.timeout(300)
@pytest.mark.parametrize("store", ["msc", "s3"])
def test_fsdp2_on_a_bucket_resumes_bitwise_builds_the_bundle_from_every_ranks_shards_and_consolidates_there(tmp_path, references, store, request):
    # checkpoint_dir on multi-storage-client (its POSIX profile) or the local S3 endpoint; each rank stages and uploads its own shards
    import json
    import subprocess
    import sys

    from object_stores import MSC_PROFILE, download_latest, latest, orphans

    url = f"msc://{MSC_PROFILE}/fsdp2" if store == "msc" else f"s3://{request.getfixturevalue('s3_endpoint').bucket()}/fsdp2"
    if store == "msc":
        request.getfixturevalue("msc_posix")
    local = tmp_path / "local"
    on_msc = [f"checkpoint.checkpoint_dir={url}", f"checkpoint.local_dir={local}"]
    first = _run(local, "fsdp2", 2, "safetensors", on_msc, signal_rank=1, signal_at_step=SIGNAL_AT)
    assert first.codes == [ExitCode.PREEMPTED] * 2
    stopped = latest(url)
    second = _run(local, "fsdp2", 2, "safetensors", on_msc)
    assert second.codes == [ExitCode.DONE] * 2
    copy = download_latest(url, tmp_path / "copy")  # the final checkpoint, its bundle built from both ranks' shards
    assert (copy / latest(url) / "model/consolidated/model.safetensors.index.json").is_file()
    result = compare(local, references("fsdp2", 2), weights=lambda d: mesh_final_weights(copy) if d == local else mesh_final_weights(d))
    assert result.identical, result.detail
    assert orphans(url) == []

    # resilience consolidate on the bucket: the preempted checkpoint gets its bundle; verify checks it
    target = f"{url}/{stopped}"
    done = subprocess.run([sys.executable, "-m", "resilience", "consolidate", target, "--no-progress"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    verify = subprocess.run([sys.executable, "-m", "resilience", "verify", target, "--json", "--no-progress"], capture_output=True, text=True, timeout=60)
    doc = json.loads(verify.stdout)
    assert verify.returncode == 0 and doc["ok"] and doc["checkpoints"][0]["bundle"] == "verified", verify.stdout
