"""Checkpoints in an object store (checkpoint.dir=s3://bucket/prefix), against a real S3 API server that the
module starts on loopback (moto's, as MinIO or AWS would answer): saved there, sealed by the manifest written
last, resumed bitwise, kept `keep` at a time, partial ones ignored, damaged ones refused naming the object,
a missing bucket or missing credentials one line before training."""

import os
import random
import re
import signal
import subprocess
import sys

import pytest
import torch

from launcher.checkpoint import choose, complete, crc32, full, layout, manifest, storage
from launcher.errors import UserError
from recipes.components.mlp import MLP
from tests.conftest import QUICKSTART, REPO, SMALL, assert_same_weights, state_dict
from tests.conftest import train as conftest_train
from tests.pace import paced
from tests.s3 import BUCKET, SECRET, s3  # noqa: F401

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")


NO_PLAN = "logging.memory_plan=false"  # no planner process beside a run: no test here checks its `memory:` line


def train(run_dir, *overrides: str) -> dict:
    """conftest's train (in this process), without the memory planner."""
    return conftest_train(run_dir, NO_PLAN, *overrides)


def objects(store, prefix):
    """The keys under `prefix`, relative to it."""
    return store.objects(prefix)


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """40 steps in one go, on the local disk: what every resumed run must equal."""
    run = tmp_path_factory.mktemp("whole")
    train(run, "trainer.max_steps=40")
    return run / "model.pt"


@pytest.mark.slow  # a longer run: left out of the fast tier (-m "not slow")
def test_a_run_saves_to_s3_and_a_run_on_another_machine_resumes_bitwise(s3, tmp_path, whole):
    url = f"s3://{BUCKET}/resumed"
    train(tmp_path / "first", "trainer.max_steps=20", "checkpoint.every=10", f"checkpoint.dir={url}")
    assert objects(s3, "resumed") == [f"step_{n}/{f}" for n in (10, 20) for f in ("manifest.json", "model.pt", "state.pt")]
    assert not (tmp_path / "first" / "checkpoints").exists()  # no local copy; the logs and model.pt stay local
    assert_same_weights(tmp_path / "first" / "model.pt", _fetched(s3, "resumed/step_20/model.pt", tmp_path))
    # another machine (a fresh run folder), the same checkpoint.dir: it continues from step 20
    train(tmp_path / "second", "trainer.max_steps=40", "checkpoint.every=10", f"checkpoint.dir={url}")
    assert_same_weights(whole, tmp_path / "second" / "model.pt")
    assert objects(s3, "resumed")[-3:] == [f"step_40/{f}" for f in ("manifest.json", "model.pt", "state.pt")]
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert written and not [p for p in written if SECRET.encode() in p.read_bytes()]


def _fetched(store, key, folder):
    path = folder / key.replace("/", "_")
    store.client.download_file(BUCKET, key, str(path))
    return path


@pytest.mark.slow  # a longer run: left out of the fast tier (-m "not slow")
def test_keep_deletes_old_checkpoints_only_after_the_new_manifest(s3, tmp_path, monkeypatch):
    events = []
    write, remove = manifest.write, layout._remove
    monkeypatch.setattr(manifest, "write", lambda folder, step, *a, **k: (write(folder, step, *a, **k),
                                                                          events.append(("sealed", step))))
    monkeypatch.setattr(layout, "_remove", lambda p: (events.append(("deleted", layout.step_of(p))), remove(p)))
    train(tmp_path, "trainer.max_steps=40", "checkpoint.every=10", "checkpoint.keep=2", f"checkpoint.dir=s3://{BUCKET}/kept")
    assert {k.split("/")[0] for k in objects(s3, "kept")} == {"step_30", "step_40"}
    assert [e for e in events if e[0] == "sealed"] == [("sealed", n) for n in (10, 20, 30, 40)]
    for deleted in (10, 20):  # after the manifest of the save two later (keep=2), never before
        last = max(i for i, e in enumerate(events) if e == ("deleted", deleted))  # before: its prefix made empty
        assert last > events.index(("sealed", deleted + 20))


@pytest.mark.slow  # a longer run: left out of the fast tier (-m "not slow")
def test_a_partial_checkpoint_is_ignored_by_resume_and_deleted_by_the_next_save(s3, tmp_path, whole):
    url = f"s3://{BUCKET}/partial"
    train(tmp_path / "a", "trainer.max_steps=20", "checkpoint.every=10", f"checkpoint.dir={url}")
    for n in (25, 30):  # killed before their manifests: objects without one
        s3.client.copy_object(Bucket=BUCKET, Key=f"partial/step_{n}/model.pt", CopySource=f"{BUCKET}/partial/step_20/model.pt")
    folder = storage.location(url)
    assert [p.name for p in complete(folder)] == ["step_10", "step_20"]
    assert choose(folder, "auto")[0] == folder / "step_20"
    train(tmp_path / "a", "trainer.max_steps=40", "checkpoint.every=10", f"checkpoint.dir={url}")
    assert_same_weights(whole, tmp_path / "a" / "model.pt")
    assert "step_25/model.pt" not in objects(s3, "partial")  # deleted once step 30 was sealed again


@pytest.mark.slow  # a longer run: left out of the fast tier (-m "not slow")
def test_a_damaged_or_missing_object_is_refused_naming_it(s3, tmp_path):
    url = f"s3://{BUCKET}/damaged"
    train(tmp_path, "trainer.max_steps=20", "checkpoint.every=10", f"checkpoint.dir={url}")
    key = "damaged/step_20/model.pt"
    data = bytearray(s3.client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0x01  # one bit, same size
    s3.client.put_object(Bucket=BUCKET, Key=key, Body=bytes(data))
    with pytest.raises(UserError, match=r"step_20/model.pt|model.pt: CRC-32 \w+, the manifest says") as named:
        train(tmp_path, "trainer.max_steps=40", f"checkpoint.dir={url}", f"checkpoint.resume={url}/step_20")
    assert "damaged (model.pt: CRC-32" in str(named.value)
    # resume=auto steps back to step_10 but leaves no newer checkpoint of another history beside its own
    with pytest.raises(UserError, match=r"holds step_20 \(damaged: model.pt: CRC-32 \w+, the manifest says \w+\)"):
        train(tmp_path, "trainer.max_steps=40", f"checkpoint.dir={url}")
    s3.client.delete_object(Bucket=BUCKET, Key="damaged/step_10/state.pt")
    with pytest.raises(UserError, match=r"damaged \(state.pt: .*no such object.*, the manifest lists it\)"):
        train(tmp_path, "trainer.max_steps=40", f"checkpoint.dir={url}", f"checkpoint.resume={url}/step_10")


@pytest.mark.slow  # three runs killed and resumed, as tests/test_faults.py's (25 s): the full suite runs it
def test_a_kill_inside_an_upload_resumes_from_the_newest_sealed_checkpoint(s3, tmp_path, capsys):
    """SIGKILL at two seeded instants of the saves (every chunk torch.save writes to the store is one,
    tests/save_crash.py): what the store holds then resumes bitwise from its newest sealed checkpoint."""
    from launcher.cli import main as launcher_main
    from tests.save_crash import RECIPE, run

    def into(name):
        return [f"checkpoint.dir=s3://{BUCKET}/{name}", NO_PLAN]

    done = run(tmp_path / "reference", extra=into("crash_reference"))
    assert done.returncode == 0, done.stderr[-2000:]
    total = int(re.search(r"save_crash: rank 0 events=(\d+)", done.stderr).group(1))
    for kill_at in random.Random(0).sample(range(1, total + 1), 2):
        name = f"crash_{kill_at}"
        killed = run(tmp_path / name, kill_at, into(name))
        assert killed.returncode == -signal.SIGKILL and "save_crash: killed" in killed.stderr, killed.stderr[-2000:]
        newest, _ = choose(storage.location(f"s3://{BUCKET}/{name}"), "auto")
        capsys.readouterr()
        # the resume in this process (what it reads from the store is checked, not its process), on one thread
        # as the reference's (tests/save_crash.py runs it with OMP_NUM_THREADS=1)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            assert launcher_main([*RECIPE, *into(name), f"run_dir={tmp_path / name}"]) == 0
        finally:
            torch.set_num_threads(threads)
        assert newest is None or f"resumed from {newest} " in capsys.readouterr().out
        assert_same_weights(tmp_path / "reference" / "model.pt", tmp_path / name / "model.pt")


def test_starting_over_onto_another_runs_checkpoints_is_refused(s3, tmp_path):
    url = f"s3://{BUCKET}/taken"
    train(tmp_path / "a", "trainer.max_steps=10", "checkpoint.every=10", f"checkpoint.dir={url}")
    with pytest.raises(UserError, match="holds another run's checkpoints .step_10. and this run starts over"):
        train(tmp_path / "b", "trainer.max_steps=10", "checkpoint.resume=never", f"checkpoint.dir={url}")


@pytest.mark.slow  # a longer run: left out of the fast tier (-m "not slow")
def test_init_from_and_export_read_an_s3_checkpoint(s3, tmp_path):
    url = f"s3://{BUCKET}/exported"
    train(tmp_path / "a", "trainer.max_steps=10", "checkpoint.every=10", f"checkpoint.dir={url}")
    out = subprocess.run([sys.executable, "-m", "launcher.export", f"{url}/step_10", str(tmp_path / "out.pt")],
                         cwd=REPO, capture_output=True, text=True, timeout=paced(120))
    assert out.returncode == 0, out.stderr
    assert f"from {url}/step_10" in out.stdout
    assert_same_weights(tmp_path / "a" / "model.pt", tmp_path / "out.pt")
    model = MLP()
    from launcher.checkpoint import load_model_state

    load_model_state(model, f"{url}/step_10")
    assert all(torch.equal(v, state_dict(tmp_path / "out.pt")[k]) for k, v in model.state_dict().items())


@pytest.mark.slow  # a longer run: left out of the fast tier (-m "not slow")
def test_a_missing_bucket_or_no_credentials_is_one_line_before_training(s3, tmp_path, capsys):
    from launcher.cli import main as launcher_main
    from launcher.export import main as export_main

    args = [str(QUICKSTART), *SMALL, f"run_dir={tmp_path}"]
    # one process's mistakes, in this one (as tests/test_bad_input.py's); the missing keys in a process of its own,
    # started without the AWS_* environment
    code = launcher_main([*args, "checkpoint.dir=s3://no-such-bucket/run"])
    out, err = capsys.readouterr()
    assert code == 2 and "training" not in err + out
    assert err.strip().splitlines()[-1].endswith(
        "checkpoint.dir: s3://no-such-bucket/run: no bucket 'no-such-bucket' there; create it, or name an existing "
        "one (AWS_ENDPOINT_URL names the store)"), err
    bare = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    bare.update(AWS_ENDPOINT_URL=os.environ["AWS_ENDPOINT_URL"], AWS_EC2_METADATA_DISABLED="true",
                AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"), AWS_CONFIG_FILE=str(tmp_path / "none"))
    nokeys = subprocess.run([sys.executable, "-m", "launcher", *args, f"checkpoint.dir=s3://{BUCKET}/run"], cwd=REPO,
                            capture_output=True, text=True, timeout=paced(120), env=bare)
    assert nokeys.returncode == 2, nokeys.stderr
    assert "no credentials for the object store; set AWS_ACCESS_KEY_ID" in nokeys.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "recipe.yaml").exists()  # refused before the run folder was written
    capsys.readouterr()
    try:
        code = export_main(["s3://no-such-bucket/run/step_10", str(tmp_path / "out.pt")])
    except SystemExit as e:  # argparse's errors, as `python -m launcher.export` ends with them
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and err.strip().splitlines()[-1].endswith(
        "CHECKPOINT: s3://no-such-bucket/run/step_10: no bucket 'no-such-bucket' there; create it, or name an "
        "existing one (AWS_ENDPOINT_URL names the store)"), err
    with pytest.raises(UserError, match="^checkpoint.init_from: s3://no-such-bucket/run/step_10: no bucket"):
        train(tmp_path / "init", "checkpoint.init_from=s3://no-such-bucket/run/step_10")


def test_full_checkpoints_in_fsspec_memory_store(tmp_path):
    """Any fsspec URL: memory:// holds a full checkpoint sealed by its manifest, as S3 does."""
    folder = storage.location("memory://launcher-test/run")
    model = MLP()
    for step in (1, 2, 3):
        full.write(folder, step, model.state_dict(), {"x": step}, keep=2)
    assert [p.name for p in complete(folder)] == ["step_2", "step_3"]
    assert manifest.verify(folder / "step_3") is None
    (folder / "step_3" / "manifest.json").remove()
    assert choose(folder, "auto")[0] == folder / "step_2"
    storage.removed(folder)


@pytest.mark.slow
def test_fsdp_saves_shards_to_s3_and_one_process_resumes_them_as_from_a_local_disk(s3, tmp_path, capsys):
    """fsdp x 2 (torchrun, gloo) writes DCP's shards through fsspec, sealed by rank 0's manifest (step 20 in
    the background, with async_save; the final step 40 at once), without reading a shard back; one process
    resumes from them bitwise as from the same run's shards on a local disk, fetching each byte once; export
    writes the run's newest checkpoint, found through its recipe, as an HF folder."""
    from launcher.cli import main as launcher_main
    from tests.several_runs import several
    from tests.test_fsdp import FSDP, QUICK

    url = f"s3://{BUCKET}/fsdp"
    s3.fetched.clear()
    # the two fsdp runs, to S3 and to the local disk, one after the other in one torchrun launch
    ranks = several({"s3": [*QUICK, *FSDP, NO_PLAN, f"checkpoint.dir={url}", "checkpoint.async_save=true",
                            f"run_dir={tmp_path / 's3'}"],
                     "local": [*QUICK, *FSDP, NO_PLAN, f"run_dir={tmp_path / 'local'}"]}, tmp_path)
    assert [results[name]["error"] for results in ranks for name in ("s3", "local")] == [None] * 4, ranks
    assert not [key for key in s3.fetched_under("fsdp") if not key.endswith("/manifest.json")], s3.fetched
    assert_same_weights(tmp_path / "local" / "model.pt", tmp_path / "s3" / "model.pt")
    assert [k for k in objects(s3, "fsdp") if k.startswith("step_20/")] == [
        f"step_20/{f}" for f in (".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json")]
    step_20 = storage.location(f"{url}/step_20")
    assert manifest.verify(step_20) is None  # by the ETags recorded: the CRC-32s kept while writing are right too
    assert all(crc32(step_20 / name) == entry["crc32"] for name, entry in manifest.read(step_20).items())
    one = [*QUICK, "strategy=single", NO_PLAN]  # one process: the resumes train in this one
    capsys.readouterr()
    s3.fetched.clear()
    assert launcher_main([*one, f"checkpoint.resume={url}/step_20", f"run_dir={tmp_path / 'one_s3'}"]) == 0
    assert "written by 2 processes, resharded to 1" in capsys.readouterr().out
    sizes, fetched = s3.sizes("fsdp/step_20"), s3.fetched_under("fsdp/step_20")
    shards = [key for key in sizes if key.endswith(".distcp")]
    assert len(shards) == 2 and all(0 < fetched.get(key, 0) <= sizes[key] for key in shards), (fetched, sizes)
    assert launcher_main([*one, f"checkpoint.resume={tmp_path / 'local' / 'checkpoints' / 'step_20'}",
                          f"run_dir={tmp_path / 'one_local'}"]) == 0
    assert_same_weights(tmp_path / "one_local" / "model.pt", tmp_path / "one_s3" / "model.pt")
    from safetensors.torch import load_file

    from launcher.export import main as export

    (tmp_path / "config.json").write_text('{"architectures": ["MLP"]}')
    assert export([str(tmp_path / "s3"), str(tmp_path / "hf"), "--format", "hf", "--config", str(tmp_path / "config.json")]) == 0
    assert f"from {url}/step_40" in capsys.readouterr().out
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert exported.keys() == state_dict(tmp_path / "s3" / "model.pt").keys()
    assert all(torch.equal(v, exported[k]) for k, v in state_dict(tmp_path / "s3" / "model.pt").items())
    key = "fsdp/step_20/__1_0.distcp"  # one bit flipped in a shard: another object, another ETag, refused by CRC-32
    data = bytearray(s3.client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0x01
    s3.client.put_object(Bucket=BUCKET, Key=key, Body=bytes(data))
    assert re.fullmatch(r"__1_0.distcp: CRC-32 \w+, the manifest says \w+", manifest.verify(step_20) or "")


def test_a_local_checkpoint_dir_outside_the_run_folder(tmp_path, whole):
    """checkpoint.dir as a folder: written there as in <run_dir>/checkpoints (renamed into place, `latest`),
    resumed from there, and not moved aside when another run would start over in it."""
    elsewhere = tmp_path / "elsewhere"
    train(tmp_path / "a", "trainer.max_steps=20", "checkpoint.every=10", f"checkpoint.dir={elsewhere}")
    assert sorted(p.name for p in elsewhere.iterdir()) == [".lock", "latest", "step_10", "step_20"]  # .lock: its lock
    assert not (tmp_path / "a" / "checkpoints").exists()
    train(tmp_path / "b", "trainer.max_steps=40", "checkpoint.every=10", f"checkpoint.dir={elsewhere}")
    assert_same_weights(whole, tmp_path / "b" / "model.pt")
    with pytest.raises(UserError, match="holds another run's checkpoints .step_40. and this run starts over"):
        train(tmp_path / "c", "checkpoint.resume=never", f"checkpoint.dir={elsewhere}")


def test_either_client_reads_what_the_other_wrote_and_a_run_without_s3torchconnector_says_it_uses_s3fs(
        s3, tmp_path, monkeypatch, capsys, one_rank):
    """s3torchconnector (where installed) and s3fs (without it) write the same objects: DCP's shards written by
    one resume bitwise through the other, and full checkpoints too. Where s3torchconnector is missing, s3://
    goes through s3fs and the run says so once."""
    pytest.importorskip("s3torchconnector")
    from launcher.checkpoint import s3_connector

    fsdp = ["strategy=fsdp", "devices=cpu", "logging.memory_plan=false"]
    train(tmp_path / "whole", *fsdp, "trainer.max_steps=20")
    fallback = "s3:// checkpoints go through s3fs: s3torchconnector, the faster client, is not installed " \
               "(pip install 'launcher[s3]' installs both)"
    for first, then in (("s3fs", "s3torchconnector"), ("s3torchconnector", "s3fs")):
        url = f"s3://{BUCKET}/{first}-then-{then}"
        for run, client, steps in ((first, first, ["trainer.max_steps=10", "checkpoint.every=10"]),
                                   (then, then, ["trainer.max_steps=20"])):
            with monkeypatch.context() as where:
                where.setattr(s3_connector, "installed", lambda: client == "s3torchconnector")
                train(tmp_path / run, *fsdp, *steps, f"checkpoint.dir={url}")
            out = capsys.readouterr().out
            assert out.count(fallback) == (client == "s3fs"), out  # said once, where s3fs moves them
        assert f"resumed from {url}/step_10 (step 10" in out
        assert_same_weights(tmp_path / "whole" / "model.pt", tmp_path / then / "model.pt")
    url = f"s3://{BUCKET}/full"  # full checkpoints (model.pt, state.pt), each way
    for steps, client in ((10, "s3fs"), (20, "s3torchconnector"), (30, "s3fs")):
        with monkeypatch.context() as where:
            where.setattr(s3_connector, "installed", lambda: client == "s3torchconnector")
            train(tmp_path / f"full_{steps}", f"trainer.max_steps={steps}", "checkpoint.every=10", f"checkpoint.dir={url}")
        assert steps == 10 or f"resumed from {url}/step_{steps - 10} " in capsys.readouterr().out
    train(tmp_path / "straight", "trainer.max_steps=30")
    assert_same_weights(tmp_path / "straight" / "model.pt", tmp_path / "full_30" / "model.pt")


# What s3torchconnector 1.5.0 said in each case (moto's server, tests/flaky_store.py), and the line it becomes.
S3_EXCEPTIONS = [
    ("Client error: No signing credentials available, see CRT debug logs", PermissionError,
     "no credentials for the object store; set AWS_ACCESS_KEY_ID"),
    ("Service error: The bucket does not exist", FileNotFoundError, "no such bucket"),
    ('Client error: Unknown response error: MetaRequestResult { response_status: 404, crt_error: Error(14343, '
     '"aws-c-s3: AWS_ERROR_S3_INVALID_RESPONSE_STATUS, Invalid response status from request"), error_response_body: '
     'Some("<?xml version=\\"1.0\\"?>\\n<Error><Code>NoSuchBucket</Code><Message>The specified bucket does not exist'
     '</Message></Error>") }', FileNotFoundError, "no such bucket"),
    ("Service error: The object was not found", FileNotFoundError, "no such object"),
    ("Client error: Forbidden: Access Denied", PermissionError, "Access Denied"),
    ("Client error: Unknown CRT error: CRT error 1051: aws-c-io: AWS_IO_SOCKET_CLOSED, socket is closed.", OSError,
     "S3Exception: socket is closed (AWS_IO_SOCKET_CLOSED)"),
    ('Client error: Unknown response error: MetaRequestResult { response_status: 503, error_response_body: Some("<Error>'
     '<Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>") }', OSError,
     "S3Exception: Please reduce your request rate. (SlowDown)"),
]


@pytest.mark.parametrize("text, kind, line", S3_EXCEPTIONS, ids=[c[2][:24] for c in S3_EXCEPTIONS])
def test_s3torchconnectors_errors_are_one_line_oserrors(text, kind, line):
    S3Exception = type("S3Exception", (Exception,), {"__module__": "s3torchconnectorclient._mountpoint_s3_client"})
    mapped = storage.store_error(S3Exception(text))
    assert type(mapped) is kind and mapped.strerror.startswith(line) and "\n" not in str(mapped)


def test_dcp_through_s3fs_goes_to_the_endpoint_of_now_not_to_an_earlier_file_systems(s3, monkeypatch):
    """fsspec shares a file system made with the same arguments, whatever endpoint the environment named when it
    was made: DCP's s3fs writer and reader make their own (a store gone since would take every upload)."""
    import fsspec

    from launcher.checkpoint import sharded

    with monkeypatch.context() as m:
        m.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # a store gone (an earlier job's, say)
        fsspec.filesystem("s3").connect()  # fsspec's shared instance, its client made now
    folder = storage.location(f"s3://{BUCKET}/fresh", client="s3fs")
    sharded.write(folder, {"w": torch.arange(4.0)})
    state = {"w": torch.zeros(4)}
    sharded.read(folder, state)
    assert torch.equal(state["w"], torch.arange(4.0))


KEYS = "name a prefix of letters, digits and _ - . ! ' ( ) = , + between slashes"
USE = "use a local folder (a path, or file:///path) or s3://bucket/prefix (S3 and S3-compatible stores)"
NOT_A_STORE = [  # checkpoint.dir, the end of its one line
    ("http://127.0.0.1:9/ckpt", f"http:// is not a place for checkpoints; {USE}"),
    ("memory://bucket/run", f"memory:// lives in this process alone, and every checkpoint in it would be lost when the "
                            f"run ends; {USE}"),
    (f"s3://{BUCKET}/p#1?versionId=2", f"the key holds # ?; {KEYS}, which both S3 clients read as written (s3fs takes "
                                       f"?versionId= as a version and ? * [ as a glob)"),
    (f"s3://{BUCKET}/runs/lr*[2]", "the key holds * [ ]; "),
    (f"s3://{BUCKET}/a::b", "the key holds :; "),
    (f"s3://{BUCKET}/a//b", f"the key has an empty part (//), or . or .. between slashes, which some S3 clients "
                            f"rewrite; {KEYS}"),
    (f"s3://{BUCKET}/a/../b", "the key has an empty part (//), or . or .. between slashes"),
    ("file://otherhost/tmp/ckpt", f"a file:// URL names a folder of this machine (file:///path or "
                                  f"file://localhost/path), not one on otherhost; {USE}"),  # once host/path, here
    # a URL with one slash, once the local folder ./s3:/launcher-ckpt/one-slash (exit 0, nothing in the store)
    (f"s3:/{BUCKET}/one-slash", f"begins as a URL does (s3:) without the // that follows a URL's scheme, so it would "
                                f"be the local folder ./s3:/{BUCKET}/one-slash; write s3://{BUCKET}/one-slash if a URL "
                                f"is meant, or ./s3:/{BUCKET}/one-slash for a local folder of that name"),
    # bucket names that no store has: once "cannot reach the object store ...; check AWS_ENDPOINT_URL and the network"
    ("s3://launcher?ckpt/run", "the bucket's name holds ?; a bucket is named by letters, digits, . - and _ (AWS: 3 to "
                               "63 lowercase letters, digits, . and -), as s3://bucket/prefix"),
    ("s3://launcher*/run", "the bucket's name holds *; "),
]


@pytest.mark.parametrize("url, line", NOT_A_STORE, ids=[u.split("://")[0] + "-" + str(i) for i, (u, _) in enumerate(NOT_A_STORE)])
def test_a_checkpoint_dir_that_cannot_hold_checkpoints_is_one_line_before_training(s3, tmp_path, capsys, url, line):
    """A scheme of no store (http://, memory://, gone with the process), or an S3 key that s3fs and
    s3torchconnector read differently (so that saves look fine and none resumes): exit 2, one line, nothing
    written."""
    from launcher.cli import main as launcher_main

    code = launcher_main([str(QUICKSTART), *SMALL, f"run_dir={tmp_path}", f"checkpoint.dir={url}"])
    out, err = capsys.readouterr()
    assert code == 2 and "training" not in out and len(err.strip().splitlines()) == 1, out + err
    assert f"checkpoint.dir: {url.rstrip('/')}: {line}" in err, err
    assert not (tmp_path / "recipe.yaml").exists() and not s3.objects("p#1") and not os.path.exists(url.split(":")[0] + ":")


def test_a_checkpoint_dir_of_no_store_stops_every_rank_of_ddp_x2_with_its_line(s3, tmp_path):
    from tests.several_runs import several

    ranks = several({"memory": [str(QUICKSTART), *SMALL, "strategy=ddp", f"run_dir={tmp_path}",
                                "checkpoint.dir=memory://bucket/run"]}, tmp_path)
    assert [rank["memory"]["error"] for rank in ranks] == [
        "UserError: checkpoint.dir: memory://bucket/run: memory:// lives in this process alone, and every checkpoint "
        f"in it would be lost when the run ends; {USE}"] * 2, ranks


def test_a_file_url_is_a_local_folder_made_where_missing(tmp_path, whole):
    """checkpoint.dir=file:///path is the folder /path, made where it is missing, as a path would be: checkpoints
    renamed into place with `latest`, resumed from there."""
    folder = tmp_path / "missing" / "checkpoints"
    train(tmp_path / "a", "trainer.max_steps=20", "checkpoint.every=10", f"checkpoint.dir=file://{folder}")
    assert sorted(p.name for p in folder.iterdir()) == [".lock", "latest", "step_10", "step_20"]
    assert (tmp_path / "a" / "model.pt").exists()
    train(tmp_path / "a", "trainer.max_steps=40", "checkpoint.every=10", f"checkpoint.dir=file://localhost{folder}")
    assert_same_weights(whole, tmp_path / "a" / "model.pt")
