"""Checkpoints on object storage against real endpoints: moto's S3 server on 127.0.0.1 (started
once per session, stopped by PID) and multi-storage-client's POSIX profile; a TCP proxy in front of
moto makes it fail for real (stopped, throttling). One rank, in process (resilient_loop over a
linear model): the atomic publish, the commit point, retention, LOWEST_VAL, re-saves, orphans, the
endpoint failing, the configuration errors. The multi-rank runs (digits, FSDP2) are in tests/e2e/."""

from __future__ import annotations

import json
import uuid

import pytest
import torch

from object_stores import Proxy, keys, restore_env, set_env
from resilience import resilient_loop
from resilience.checkpoint import writer
from resilience.checkpoint.layout import LATEST, LOWEST_VAL, MANIFEST
from resilience.checkpoint.storage.manifest import OBJECTS, read_manifest, validate
from resilience.checkpoint.storage.object_path import root_location
from resilience.checkpoint.storage.object_store import PreconditionFailed
from resilience.checkpoint.storage.s3_store import S3Store
from resilience.checkpoint.storage.stores import forget_stores, open_store
from resilience.checkpoint.writer import CheckpointSaveError
from resilience.config import CheckpointConfig, ConfigError
from tiny_runs import train_linear

pytestmark = pytest.mark.usefixtures("no_launcher_environment")

BATCHES = [torch.full((2, 2), float(i)) for i in range(12)]


class Unsized:
    """Three batches, an iterable without a length: the loop cannot know a step is the last of the
    epoch, so the end of training saves that step again as the final one (``save_consolidated: final``)."""

    def __iter__(self):
        return iter(BATCHES[:3])


def run(url, local, max_steps, *, val=None, checkpoint=None, hook=None, data=BATCHES):
    """Train a linear model to ``max_steps`` (``None``: one epoch) with a save every step; returns the losses logged."""
    cfg = {
        "step_scheduler": {"max_steps": max_steps, "ckpt_every_steps": 1, "num_epochs": 1},
        "checkpoint": {"checkpoint_dir": url, "local_dir": str(local), **(checkpoint or {})},
    }
    writer.fault_hook = hook
    try:
        return train_linear(cfg, data, val=val)
    finally:
        writer.fault_hook = None


def committed(url):
    """Names of the checkpoints with a manifest under ``url``."""
    return sorted(k.split("/")[0] for k in keys(url) if k.endswith("/" + MANIFEST) and k.count("/") == 1)


def test_store_interface_on_s3_range_list_delete_and_conditional_pointer(s3_endpoint):
    url = f"s3://{s3_endpoint.bucket()}/p"
    store = open_store(url)
    store.put_bytes("a/b/c", b"0123456789")
    assert store.get_bytes("a/b/c", 3, 4) == b"3456" and store.head("a/b/c").size == 10 and store.head("nope") is None
    assert store.list("", recursive=False) == ([], ["a"]) and [o.rel for o in store.list("a")[0]] == ["a/b/c"]
    store.write_pointer(LATEST, "epoch_0_step_1")  # If-None-Match: *
    other = S3Store(url)  # a second writer (its own client, its own view of the pointer)
    assert other.read_pointer(LATEST) == "epoch_0_step_1"
    other.write_pointer(LATEST, "epoch_0_step_2")  # If-Match on what it read
    with pytest.raises(PreconditionFailed, match="moved by another writer"):
        store.write_pointer(LATEST, "epoch_0_step_3")  # its ETag is stale: refused, not overwritten
    assert store.read_pointer(LATEST) == "epoch_0_step_2"
    store.write_pointer(LATEST, "epoch_0_step_3")  # having read it again
    assert other.read_pointer(LATEST) == "epoch_0_step_3"
    assert store.delete_prefix("") == 2 and store.list("") == ([], [])


def test_configuration_errors_name_the_key_before_any_step(s3_endpoint, msc_posix, tmp_path, monkeypatch):
    for url in ("gs://bucket/ck", "hdfs://nn/ck"):
        with pytest.raises(ConfigError, match=r"checkpoint\.checkpoint_dir.*not supported.*s3://bucket/prefix, msc://profile/prefix"):
            CheckpointConfig(checkpoint_dir=url)
    with pytest.raises(ConfigError, match="names no bucket"):
        CheckpointConfig(checkpoint_dir="s3:///ck")
    with pytest.raises(ConfigError, match="local_dir.*only used with an object-store checkpoint_dir"):
        CheckpointConfig(checkpoint_dir=str(tmp_path), local_dir=str(tmp_path / "x"))
    steps = []

    def attempt(url):
        with pytest.raises(ConfigError) as caught:
            with resilient_loop({"checkpoint": {"checkpoint_dir": url, "local_dir": str(tmp_path)}}, model=torch.nn.Linear(2, 1), dataloader=BATCHES) as loop:
                steps.extend(loop)
        return str(caught.value)

    assert "bucket 'no-such-bucket' does not exist at endpoint " + s3_endpoint.url in attempt("s3://no-such-bucket/ck")
    assert "msc profile 'nope'" in attempt("msc://nope/ck") and "not found" in attempt("msc://nope/ck")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    forget_stores()
    text = attempt(f"s3://{s3_endpoint.bucket()}/ck")
    assert text.startswith("checkpoint.checkpoint_dir='s3://") and "no AWS credentials found" in text and "AWS_ACCESS_KEY_ID" in text and "~/.aws" in text
    forget_stores()
    assert steps == [], "refused before the first step"


@pytest.mark.parametrize("scheme", ["s3", "msc"])
def test_a_bucket_run_resumes_exactly_keeps_the_right_checkpoints_and_moves_lowest_val(s3_endpoint, msc_posix, tmp_path, scheme):
    from object_stores import MSC_PROFILE

    url = f"s3://{s3_endpoint.bucket()}/run" if scheme == "s3" else f"msc://{MSC_PROFILE}/{uuid.uuid4().hex[:8]}"
    reference = run(f"{url}-reference", tmp_path / "ref", 8)
    val = {2: 0.1, 4: 0.5, 5: 0.3}
    checkpoint = {"max_recent_checkpoints": 2}
    assert run(url, tmp_path / "a", 5, val=val, checkpoint=checkpoint) == reference[:5]
    assert committed(url) == ["epoch_0_step_2", "epoch_0_step_4", "epoch_0_step_5"]  # LOWEST_VAL's, then the newest two
    # the second run: resumes from step 5, and is the uninterrupted run's continuation, bitwise
    assert run(url, tmp_path / "b", 8, val=val, checkpoint=checkpoint) == reference[5:]
    root = root_location(url)
    assert root.store.read_pointer(LATEST) == "epoch_0_step_8" and root.store.read_pointer(LOWEST_VAL) == "epoch_0_step_2"
    assert committed(url) == ["epoch_0_step_2", "epoch_0_step_7", "epoch_0_step_8"]
    # every object is a committed checkpoint's (the pruned ones' files and the replaced save's are gone)
    prefixes = {read_manifest(root / name)[OBJECTS] for name in committed(url)}
    for k in (k for k in keys(url) if "/" in k):
        assert k.split("/")[0] in committed(url) and (k.endswith(MANIFEST) and k.count("/") == 1 or "/".join(k.split("/")[:2]) in prefixes), k
    assert {k for k in keys(url) if "/" not in k} == {LATEST, LOWEST_VAL}
    validate(root / "epoch_0_step_8")  # every digest, from the bucket
    assert (tmp_path / "b" / "training.jsonl").exists(), "the logs are local (an object cannot be appended to)"


def test_a_failed_resave_of_the_same_step_leaves_the_previous_checkpoint_whole_and_latest(s3_endpoint, tmp_path):
    url = f"s3://{s3_endpoint.bucket()}/resave"
    root = root_location(url)
    saves = []

    def fail_resave(phase):  # the second save of step 3 (the final one, with the bundle) fails while uploading
        saves.append(phase) if phase == "staging" else None
        if phase == "upload" and len(saves) == 4:  # steps 1, 2, 3, then step 3 again
            raise OSError("injected: the upload failed")

    # save_consolidated: final makes the end of training save step 3 again, with the bundle, after its periodic save
    with pytest.raises(CheckpointSaveError, match="epoch_0_step_3 failed while uploading files.*injected.*LATEST was not moved"):
        run(url, tmp_path, None, checkpoint={"save_consolidated": "final"}, hook=fail_resave, data=Unsized())
    before = read_manifest(root / "epoch_0_step_3")
    assert root.store.read_pointer(LATEST) == "epoch_0_step_3" and before["meta"]["reason"] == "periodic"
    validate(root / "epoch_0_step_3")  # its files untouched: the re-save wrote under its own prefix
    # the next start removes what the failed save uploaded, resumes, and re-saves step 3 with the bundle
    run(url, tmp_path, None, checkpoint={"save_consolidated": "final"}, data=Unsized())
    after = read_manifest(root / "epoch_0_step_3")
    assert after["meta"]["reason"] == "final" and after[OBJECTS] != before[OBJECTS]
    assert [k.split("/")[1] for k in keys(url) if k.startswith("epoch_0_step_3/") and k.count("/") > 1] == [after[OBJECTS].split("/")[1]] * len(
        [k for k in keys(url) if k.startswith(after[OBJECTS] + "/")]
    ), "the replaced files are deleted"
    assert any(k.startswith(after[OBJECTS] + "/model/consolidated/") for k in keys(url))
    validate(root / "epoch_0_step_3")


def test_orphans_are_removed_at_the_next_start_and_committed_files_are_kept(s3_endpoint, tmp_path):
    url = f"s3://{s3_endpoint.bucket()}/orphans"
    run(url, tmp_path, 2, checkpoint={"save_consolidated": False})
    store = root_location(url).store
    kept = set(keys(url))
    orphan_ids = [uuid.uuid4().hex for _ in range(2)]
    store.put_bytes(f"epoch_0_step_9/{orphan_ids[0]}/model/x.safetensors", b"x")  # a save killed before its manifest
    store.put_bytes(f"epoch_0_step_2/{orphan_ids[1]}/optim/y", b"y")  # a re-save that never committed
    store.put_bytes("epoch_0_step_11/.bad", b"why")  # a marker left of a checkpoint that is gone
    store.put_bytes("notes/readme.txt", b"the user's own")  # not ours: never touched
    run(url, tmp_path, 2, checkpoint={"save_consolidated": False})  # resumes at step 2: nothing to train
    assert set(keys(url)) == kept | {"notes/readme.txt"}


def _at_upload_of_save(number, action):
    """A fault hook calling ``action()`` as the ``number``-th save of the run starts uploading."""
    saves = [0]

    def hook(phase):
        saves[0] += phase == "staging"
        if phase == "upload" and saves[0] == number:
            action()

    return hook


def test_the_endpoint_failing_mid_save_is_a_save_error_after_bounded_retries_and_latest_is_unchanged(s3_endpoint, tmp_path):
    bucket = s3_endpoint.bucket()
    proxy = Proxy(s3_endpoint.url)
    old = set_env({"AWS_ENDPOINT_URL": proxy.url})
    try:
        for mode, step in (("refuse", 2), ("503", 3)):
            url = f"s3://{bucket}/{mode}"
            hook = _at_upload_of_save(step, lambda mode=mode: proxy.set(mode))
            with pytest.raises(CheckpointSaveError, match=rf"epoch_0_step_{step} failed while uploading files.*LATEST was not moved"):
                run(url, tmp_path / mode, 4, checkpoint={"save_consolidated": False}, hook=hook)
            proxy.set("pass")
            assert root_location(url).store.read_pointer(LATEST) == f"epoch_0_step_{step - 1}"
        # each of the save's files was tried AWS_MAX_ATTEMPTS=3 times (botocore's backoff between), no more
        files = [k for k in keys(f"s3://{bucket}/503") if k.startswith(read_manifest(root_location(f"s3://{bucket}/503") / "epoch_0_step_2")[OBJECTS] + "/")]
        assert proxy.requests == 3 * len(files), (proxy.requests, len(files))
    finally:
        proxy.close()
        restore_env(old)


def test_an_asynchronous_save_on_a_bucket_resumes_exactly(s3_endpoint, tmp_path):
    url = f"s3://{s3_endpoint.bucket()}/async"
    reference = run(f"{url}-reference", tmp_path / "ref", 6, checkpoint={"save_consolidated": False})
    assert run(url, tmp_path / "a", 3, checkpoint={"is_async": True, "save_consolidated": False}) == reference[:3]
    assert json.loads(root_location(url).store.get_bytes(f"epoch_0_step_3/{MANIFEST}"))["meta"]["is_async"] is True
    assert run(url, tmp_path / "b", 6, checkpoint={"is_async": True, "save_consolidated": False}) == reference[3:]


def test_a_peft_model_on_a_bucket_saves_its_adapters_and_resumes_them(s3_endpoint, tmp_path):
    """Found by mypy (issue 28): a PEFT model's adapters are written ahead of the save into a
    directory beside the checkpoint; on a bucket that was the store itself, and the first save
    failed. They go to the local directory, and come back from the bucket at the resume."""
    peft = pytest.importorskip("peft")
    url = f"s3://{s3_endpoint.bucket()}/peft"

    def train(max_steps):
        torch.manual_seed(0)
        model = peft.get_peft_model(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)), peft.LoraConfig(r=1, target_modules=["0"]))
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        cfg = {
            "step_scheduler": {"max_steps": max_steps, "ckpt_every_steps": 1, "num_epochs": 1},
            "checkpoint": {"checkpoint_dir": url, "local_dir": str(tmp_path)},
        }
        with resilient_loop(cfg, model=model, optimizer=optimizer, dataloader=BATCHES) as loop:
            for step in loop:
                optimizer.zero_grad()
                model(step.batch).pow(2).mean().backward()
                optimizer.step()
        return {k: v.clone() for k, v in model.state_dict().items() if "lora_" in k}

    reference = train(3)
    assert any(v.abs().sum() > 0 for k, v in reference.items() if "lora_B" in k)  # trained
    assert any(k.startswith("epoch_0_step_3/") and k.endswith("/model/adapter_model.safetensors") for k in keys(url))
    resumed = train(3)  # nothing left to train: the adapters are the checkpoint's
    assert resumed.keys() == reference.keys() and all(torch.equal(resumed[k], reference[k]) for k in reference)
