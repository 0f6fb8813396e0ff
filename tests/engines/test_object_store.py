"""The data dir on an S3-compatible object store: moto's S3 server on loopback, started and stopped here.

The same shard is generated into `s3://<bucket>/run1` and into a local dir on the same emulator (a completion is a
function of its prompt there), so every figure the readers give must be equal on both. Then the crash leftovers
an object store can hold (an upload killed mid-way, torn temporary objects, a part a compacted file already
holds) are shown to be invisible to every reader, and `recover` removes what can be listed.
"""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import boto3  # noqa: E402 - the dev dependency moto[server] brings it; these tests must run, not skip
import dagster as dg
import duckdb
import moto.server as moto_server  # noqa: E402
import pytest

from dflash_assets.fleet.fleet import on_fleet
from dflash_assets.generation.shards import build_prompt_shard
from dflash_assets.quality import export_training_set, length_quality, run_checks
from dflash_assets.quality.planning.planner import plan_caps
from dflash_assets.store.parts import COVERS_KEY
from dflash_assets.store.schema import COMPLETION_SCHEMA
from dflash_assets.store.storage import S3Storage, lock_dir, open_storage
from dflash_assets.store.stores import completion_store, parquet_files, parquet_source
from tests.support.shards import SETTINGS, generate, write_prompts
from tests.support.shards import cont as continued

BUCKET = "dflash-test"
N = 40
CAP = 1024  # some of the emulator's heavy-tailed outputs are cut here: truncation figures are not all zero
SHARD = "00000"


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on a free loopback port, the environment pointing at it, one bucket; a boto3 client."""
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # not a line per request in the captured log
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    try:
        with pytest.MonkeyPatch.context() as mp:
            for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_REGION", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
                mp.delenv(name, raising=False)
            mp.setenv("AWS_ACCESS_KEY_ID", "testing")
            mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
            mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
            mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
            mp.setenv("DFLASH_S3_ENDPOINT", endpoint)
            client = boto3.client("s3", endpoint_url=endpoint)
            client.create_bucket(Bucket=BUCKET)
            yield client
    finally:
        server.stop()


@pytest.fixture(scope="module")
def fleet_size():
    return 1


def write_source(path: Path) -> Path:
    # a line that is not JSON: a source reject, so the rejects table has rows too
    return write_prompts(
        path,
        ({"id": f"s{i:03d}", "prompt": f"Object store question {i}: explain it."} for i in range(N)),
        {7: "{not json"},
    )


def build(source: Path, data_dir, urls) -> None:
    on_fleet(urls, lambda f: build_prompt_shard(source, 0, SHARD, N + 1, data_dir, f, {"enable_thinking": True}))


def keys(client, prefix: str) -> list[str]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return sorted(o["Key"] for page in pages for o in page.get("Contents", []) if not o["Key"].endswith("/"))


def figures(run) -> tuple:
    return run.prompts, run.completed, run.rejected, run.failed, run.length


@pytest.fixture(scope="module")
def runs(s3, fleet_urls, tmp_path_factory):
    """One shard generated at CAP into s3://BUCKET/run1 and into a local data dir."""
    tmp = tmp_path_factory.mktemp("object_store")
    source = write_source(tmp / "prompts.jsonl")
    uri, local = f"s3://{BUCKET}/run1", tmp / "local"
    cwd = set(os.listdir("."))
    build(source, uri, fleet_urls)
    build(source, local, fleet_urls)
    # 4 in flight: answers come back 4 at a time at most, so the shard is committed in several parts of 8 rows
    # (then compacted), however the answers happen to arrive together
    parts = SETTINGS.model_copy(update={"max_in_flight_per_server": 4})
    s3_run, local_run = generate(uri, fleet_urls, CAP, parts), generate(local, fleet_urls, CAP, parts)
    assert set(os.listdir(".")) == cwd, "an s3:// data dir never creates anything in the working directory"
    return {"uri": uri, "local": local, "tmp": tmp, "s3_run": s3_run, "local_run": local_run, "source": source}


def test_shard_is_generated_and_committed_on_the_object_store(s3, runs):
    s3_run, local_run = runs["s3_run"], runs["local_run"]
    assert figures(s3_run) == figures(local_run)
    assert s3_run.completed == N and s3_run.rejected == 0 and s3_run.failed == 0
    assert 0 < s3_run.length < N, "some rows are cut at the cap, the rest stop"
    objects = keys(s3, "run1/")
    assert f"run1/prompt_shards/shard={SHARD}/prompts.parquet" in objects
    assert f"run1/rejects/shard={SHARD}/stage=source/rejects.parquet" in objects
    completions = [k for k in objects if k.startswith(f"run1/completions/shard={SHARD}/")]
    # committed in parts of 8 rows, then compacted into one object that replaced them
    assert len(completions) == 1 and completions[0].rsplit("/", 1)[1].startswith("compact-"), completions
    assert not [k for k in objects if k.rsplit("/", 1)[1].startswith(".")], "no temporary object is left"
    assert not [k for k in objects if "lock" in k], "the writer lock is not kept in the bucket"


def test_rerun_resumes_from_the_committed_objects(s3, runs, fleet_urls):
    before = keys(s3, "run1/")
    again = generate(runs["uri"], fleet_urls, CAP)
    assert again.already_done == N and again.completed == N
    assert sum(s["completed"] for s in again.servers.values()) == 0, "nothing was generated again"
    assert keys(s3, "run1/") == before


def test_duckdb_reads_the_object_store_like_the_local_dir(runs):
    uri, local = runs["uri"], runs["local"]
    files = parquet_files(uri, "completions")
    assert files and all(f.startswith(f"s3://{BUCKET}/run1/completions/") for f in files)
    assert run_checks(uri) == run_checks(local)
    assert run_checks(uri, shard=SHARD) == run_checks(local, shard=SHARD)
    assert length_quality(uri) == length_quality(local)
    assert length_quality(uri)["truncated_rows"] == runs["s3_run"].length

    def rows(data_dir):
        with duckdb.connect() as con:
            src = parquet_source(con, data_dir, "completions", COMPLETION_SCHEMA)
            return con.execute(
                f"SELECT prompt_id, content, reasoning_content, completion_tokens FROM {src} ORDER BY prompt_id"
            ).fetchall()

    assert rows(uri) == rows(local) and len(rows(uri)) == N
    plan, local_plan = plan_caps(uri, bootstrap=0), plan_caps(local, bootstrap=0)
    assert (plan.rows, plan.truncated, plan.cap) == (local_plan.rows, local_plan.truncated, local_plan.cap)
    assert plan.empirical == local_plan.empirical

    # the training export reads the object store and writes a local directory, byte for byte as from local data
    a = export_training_set(uri, runs["tmp"] / "export_s3", max_length=None)
    b = export_training_set(local, runs["tmp"] / "export_local", max_length=None)
    assert a.manifest == b.manifest and a.manifest["rows"] == N - runs["s3_run"].length
    assert a.jsonl_path.read_bytes() == b.jsonl_path.read_bytes()
    assert a.parquet_path.read_bytes() == b.parquet_path.read_bytes()
    with pytest.raises(ValueError, match="local directory"):
        export_training_set(uri, f"s3://{BUCKET}/export")


KILLED_UPLOAD = """
import os, signal, sys
from dflash_assets.store.storage import open_storage
out = open_storage(sys.argv[1]).fs.open_output_stream(sys.argv[2])
out.write(b"PAR1" + os.urandom(12 << 20))  # over the multipart threshold: parts are uploaded before close
out.flush()
os.kill(os.getpid(), signal.SIGKILL)  # killed before the upload completes
"""


def test_crash_leftovers_are_invisible_and_recover_cleans_them(s3, runs, fleet_urls):
    uri = runs["uri"]
    store = completion_store(uri, SHARD)
    prefix = f"run1/completions/shard={SHARD}/"
    checks, files, parts = run_checks(uri), parquet_files(uri, "completions"), store.parts()
    [compact] = parts

    # 1. a process killed -9 in the middle of uploading a part under its final name
    killed = f"{prefix}part-00000000000000000001-1-abcdef.parquet"
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_UPLOAD, uri, f"{BUCKET}/{killed}"], timeout=120, capture_output=True, text=True
    )
    assert proc.returncode == -9, proc.stderr
    uploads = s3.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads", [])
    assert [u["Key"] for u in uploads] == [killed], "the upload was started and left incomplete"
    assert killed not in keys(s3, prefix), "an incomplete upload is not an object"

    # 2. torn temporary objects (a crash between a write and its commit) and 3. a part a compacted file holds
    #    (a crash between a compaction's commit and its deletes): the covered part holds every row again
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}.part-00000000000000000002-1-abcdef.parquet.1234abcd.tmp", Body=b"PAR1")
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}.compact-00000000000000000003-1.parquet.5678abcd.tmp", Body=b"torn")
    covered = json.loads(store.storage.read_schema(compact).metadata[COVERS_KEY])[0]
    body = s3.get_object(Bucket=BUCKET, Key=f"run1/completions/shard={SHARD}/{compact.name}")["Body"].read()
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}{covered}", Body=body)
    assert len(keys(s3, prefix)) == 4

    assert store.parts() == parts and parquet_files(uri, "completions") == files
    assert run_checks(uri) == checks, "no reader sees any leftover: no duplicates, no torn file"

    store.recover()
    assert keys(s3, prefix) == [f"{prefix}{compact.name}"], "recover removed the temporary objects and the covered part"
    # an incomplete multipart upload cannot be listed through pyarrow: a bucket lifecycle rule
    # (AbortIncompleteMultipartUpload) reclaims it; it never was visible
    for u in uploads:
        s3.abort_multipart_upload(Bucket=BUCKET, Key=u["Key"], UploadId=u["UploadId"])

    again = generate(uri, fleet_urls, CAP)
    assert again.already_done == N and sum(s["completed"] for s in again.servers.values()) == 0
    assert run_checks(uri) == checks


def test_continuation_on_the_object_store_equals_local(runs, fleet_urls):
    uri, local = runs["uri"], runs["local"]
    parent = runs["s3_run"].config_hash
    cont = [continued(d, fleet_urls, parent, 4 * CAP) for d in (uri, local)]
    assert cont[0].continued == cont[1].continued == runs["s3_run"].length > 0
    assert cont[0].copied == cont[1].copied == N - runs["s3_run"].length
    assert run_checks(uri, config_hash=cont[0].config_hash) == run_checks(local, config_hash=cont[1].config_hash)
    assert length_quality(uri) == length_quality(local)


def test_compaction_too_large_for_one_copy_keeps_the_parts(s3, runs):
    rows = completion_store(runs["uri"], SHARD).read().to_pylist()
    store = completion_store(f"s3://{BUCKET}/big", "big")
    for row in rows[:3]:
        store.commit([{**row, "shard": "big"}])
    parts = store.parts()
    store.storage.max_streamed_bytes = 1  # as if the parts held more than one CopyObject can commit
    assert store.compact() is None and store.parts() == parts
    store.storage.max_streamed_bytes = None
    assert store.compact() is not None and len(store.parts()) == 1 and store.read().num_rows == 3


def test_writer_lock_is_local_and_exclusive(s3, runs):
    uri = runs["uri"]
    with completion_store(uri, "lock-test").lock():
        with pytest.raises(RuntimeError, match=f"s3://{BUCKET}/run1/completions/shard=lock-test is being written"):
            with completion_store(uri, "lock-test").lock():
                pass
        assert any("lock-test" in p.name for p in lock_dir().iterdir())
    with completion_store(uri, "lock-test").lock():  # released on exit
        pass
    assert not [k for k in keys(s3, "run1/") if "lock" in k]


def test_dagster_assets_run_on_an_s3_data_dir(s3, runs, fleet_urls, tmp_path):
    from dflash_assets.defs.completions.assets import completions
    from dflash_assets.defs.partitions import shard_partitions
    from dflash_assets.defs.prompts.assets import prompt_shards
    from dflash_assets.defs.quality.assets import length_quality_report
    from dflash_assets.defs.quality.checks import completions_quality_checks
    from dflash_assets.defs.resources import DataDirResource, FleetResource, PromptSourceResource, QualityResource

    data_dir = DataDirResource(path=f"s3://{BUCKET}/dagster/", local_path=str(tmp_path / "local"))
    assert data_dir.resolved() == f"s3://{BUCKET}/dagster" and data_dir.local_dir() == tmp_path / "local"
    resources = {
        "fleet": FleetResource(mode="attach", urls=",".join(fleet_urls)),
        "prompt_source": PromptSourceResource(path=str(runs["source"]), shard_size=N + 1),
        "data_dir": data_dir,
        "quality": QualityResource(),
    }
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(shard_partitions.name, [SHARD])
        result = dg.materialize(
            [prompt_shards, completions, length_quality_report, completions_quality_checks],
            partition_key=SHARD,
            instance=instance,
            resources=resources,
            raise_on_error=False,
            run_config={"ops": {"completions": {"config": {"max_output_tokens": 32000}}}},
        )
    assert result.success
    meta = result.asset_materializations_for_node("completions")[0].metadata
    assert meta["accounting"].value == f"{N} prompts = {N} completed + 0 rejected + 0 failed"
    evaluations = {e.check_name: e for e in result.get_asset_check_evaluations()}
    blocking = {o.name for o in run_checks(data_dir.resolved(), shard=SHARD) if o.blocking}
    assert blocking <= set(evaluations) and all(evaluations[name].passed for name in blocking)
    assert evaluations["accounting"].metadata["completed"].value == N
    assert keys(s3, "dagster/completions/") and (tmp_path / "local" / "reports" / f"shard={SHARD}").is_dir()


def test_data_dir_strings():
    assert isinstance(open_storage(f"s3://{BUCKET}/a/b/"), S3Storage)
    assert str(open_storage(f"s3://{BUCKET}/a/b/").root) == f"{BUCKET}/a/b"
    assert open_storage("file:///tmp/x").root == Path("/tmp/x")
    with pytest.raises(ValueError, match="mangled by pathlib"):
        open_storage(str(Path(f"s3://{BUCKET}/a")))
    with pytest.raises(ValueError, match="unsupported scheme"):
        open_storage("gs://bucket/a")
    with pytest.raises(ValueError, match="names no bucket"):
        open_storage("s3://")
