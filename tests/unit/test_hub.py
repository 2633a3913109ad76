"""Models and datasets by hub id (`org/name[@revision]`): `pipe plan` pins the revision to a
commit (the hub's, asked through a fake hub on 127.0.0.1; or the local cache's, offline), shows
it in `--explain`, puts it in the config and so in the cache key; `pipe validate` asks no hub;
what cannot be pinned is a located error that says what to do."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.hub import HubId, parse
from tests.conftest import run_cli, stub_checkpoint, stub_weights
from tests.hub_server import FakeHub

TOKEN = "hf_pipeTestSecretToken0123456789"


def release(folder: Path, files: tuple[str, ...] = ("model.safetensors", "tokenizer.json")) -> Path:
    """A checkpoint as a hub repository holds one: config.json, and `files` (weights, tokenizer:
    what a snapshot must hold, `engine.hub_files`) as stubs."""
    stub_checkpoint(folder)
    for name in files:
        if name.endswith(".safetensors"):
            stub_weights(folder / name)
        else:
            (folder / name).write_text("{}")
    return folder


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    """A fake hub serving `org/tiny` (a checkpoint's config, weights and tokenizer, stubs);
    HF_HOME in the test's folder."""
    with FakeHub() as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
        for name in ("HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
            monkeypatch.delenv(name, raising=False)
        server.add("org/tiny", release(tmp_path / "release"))
        yield server


def _write(tmp_path: Path, stages: str) -> None:
    text = "name: p\nstages:\n" + textwrap.indent(textwrap.dedent(stages), "  ")
    (tmp_path / "p.yaml").write_text(text)
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')


EVALUATE = """\
evaluate:
  kind: evaluate
  config: {{input: prompts.jsonl, checkpoints: [{model}]}}
"""


def _plan(tmp_path: Path) -> dict:
    result = run_cli("plan", "p.yaml", "--format", "json", cwd=tmp_path)
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def _errors(tmp_path: Path, command: str = "plan") -> list[str]:
    result = run_cli(command, "p.yaml", cwd=tmp_path)
    assert result.exit_code == 2, result.stdout
    return result.stderr.strip().splitlines()


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("Qwen/Qwen2.5-0.5B-Instruct", HubId("Qwen/Qwen2.5-0.5B-Instruct", "main")),
        ("org/name@v1.0", HubId("org/name", "v1.0")),
        ("org/name@refs/pr/3", HubId("org/name", "refs/pr/3")),
        ("/abs/org/name", None),
        ("./org/name", None),
        ("@sft", None),
        ("s3://bucket/ckpt", None),
        ("just-a-name", None),
        ("a/b/c", None),
    ],
)
def test_what_a_hub_id_is(value: str, expected: HubId | None):
    got = parse(value)
    assert (got and HubId(got.repo, got.revision)) == expected


def test_plan_pins_main_to_the_hubs_commit_and_explain_says_so(tmp_path: Path, hub: FakeHub):
    _write(tmp_path, EVALUATE.format(model="org/tiny"))
    sha = hub.repos["model", "org/tiny"].refs["main"]
    stage = _plan(tmp_path)["stages"]["evaluate"]
    assert stage["config"]["checkpoints"] == [f"org/tiny@{sha}"]
    assert stage["hub"] == [
        {
            "field": "checkpoints",
            "written": "org/tiny",
            "pinned": f"org/tiny@{sha}",
            "from": f"the hub ({hub.url})",
        }
    ]
    explain = run_cli("plan", "p.yaml", "--explain", cwd=tmp_path).stdout
    line = next(x for x in explain.splitlines() if x.strip().startswith("checkpoints"))
    assert line.endswith(
        f'["org/tiny@{sha}"]  <- p.yaml:5:49: org/tiny pinned to {sha} (the hub ({hub.url}))'
    )


def _key(tmp_path: Path, stage: str) -> str:
    from engine.cli.build import build_plan
    from engine.run.cache import HashCache, stage_keys

    planned = build_plan(str(tmp_path / "p.yaml"), notes=False)
    return stage_keys(planned, HashCache(str(tmp_path / "hashes.json")))[stage]


def test_a_baseline_written_as_a_checkpoints_hub_id_is_pinned_with_it(tmp_path: Path, hub: FakeHub):
    _write(
        tmp_path,
        "evaluate:\n  kind: evaluate\n"
        "  config: {input: prompts.jsonl, checkpoints: [org/tiny], baseline: org/tiny}\n",
    )
    sha = hub.repos["model", "org/tiny"].refs["main"]
    config = _plan(tmp_path)["stages"]["evaluate"]["config"]
    assert (config["checkpoints"], config["baseline"]) == ([f"org/tiny@{sha}"], f"org/tiny@{sha}")


def test_a_moved_main_changes_the_cache_key_of_the_stage_that_reads_it(
    tmp_path: Path, hub: FakeHub
):
    _write(tmp_path, EVALUATE.format(model="org/tiny"))
    before = _key(tmp_path, "evaluate")
    assert _key(tmp_path, "evaluate") == before  # the same commit: the same key
    (tmp_path / "release" / "README.md").write_text("a new commit\n")
    hub.add("org/tiny", tmp_path / "release")
    assert _key(tmp_path, "evaluate") != before


def test_a_revision_written_as_a_commit_is_kept_and_asks_nothing(tmp_path: Path, hub: FakeHub):
    sha = hub.repos["model", "org/tiny"].refs["main"]
    _write(tmp_path, EVALUATE.format(model=f"org/tiny@{sha}"))
    stage = _plan(tmp_path)["stages"]["evaluate"]
    assert stage["config"]["checkpoints"] == [f"org/tiny@{sha}"]
    assert "hub" not in stage
    assert not [r for r in hub.requests if "org/tiny" in r[1]]


def test_validate_asks_no_hub_and_plan_then_refuses_an_unknown_id(tmp_path: Path, hub: FakeHub):
    _write(tmp_path, EVALUATE.format(model="org/nope"))
    result = run_cli("validate", "p.yaml", cwd=tmp_path)
    assert (result.exit_code, result.stdout) == (0, "p.yaml: ok (1 stages)\n")
    assert hub.requests == []
    assert _errors(tmp_path) == [
        f"p.yaml:5:49: stages.evaluate.config.checkpoints: the hub ({hub.url}) knows no model "
        "'org/nope', or it is private and no token of an account that can read it was sent: "
        "check the id (org/name, as on its page); for a private one set HF_TOKEN (or run "
        "`hf auth login`); nor is there a folder 'org/nope' next to the pipeline"
    ]


def test_an_unknown_revision_is_refused_at_plan(tmp_path: Path, hub: FakeHub):
    _write(tmp_path, EVALUATE.format(model="org/tiny@v9"))
    assert _errors(tmp_path) == [
        f"p.yaml:5:49: stages.evaluate.config.checkpoints: the hub ({hub.url}) has no revision "
        "'v9' of 'org/tiny': name a branch, a tag or a commit of it"
    ]


def test_a_gated_model_without_a_token_says_what_to_do_and_with_one_is_pinned(
    tmp_path: Path, hub: FakeHub, monkeypatch: pytest.MonkeyPatch
):
    hub.repos["model", "org/tiny"].gated = True
    _write(tmp_path, "train:\n  kind: train\n  config: {input: prompts.jsonl, model: org/tiny}\n")
    assert _errors(tmp_path) == [
        f"p.yaml:5:43: stages.train.config.model: 'org/tiny' is gated: accept its terms on "
        f"{hub.url}/org/tiny with your account, then set HF_TOKEN to a token of that account "
        "(or run `hf auth login`)"
    ]
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    sha = hub.repos["model", "org/tiny"].refs["main"]
    plan = _plan(tmp_path)
    assert plan["stages"]["train"]["config"]["model"] == f"org/tiny@{sha}"
    assert hub.requests[-1][2] == f"Bearer {TOKEN}"
    assert TOKEN not in json.dumps(plan)


def test_an_unreachable_hub_gives_the_offline_advice(
    tmp_path: Path, hub: FakeHub, monkeypatch: pytest.MonkeyPatch
):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setenv("HF_ENDPOINT", dead)
    _write(tmp_path, EVALUATE.format(model="org/tiny"))
    assert _errors(tmp_path) == [
        f"p.yaml:5:49: stages.evaluate.config.checkpoints: the hub ({dead}) could not be reached "
        "in 10 s (ConnectError): without a network here, fill the cache where there is one "
        "(`hf download org/tiny`, with the same HF_HOME or HF_HUB_CACHE) and set "
        "HF_HUB_OFFLINE=1 so that pipe reads the cache"
    ]


def _cache(
    tmp_path: Path,
    repo: str,
    sha: str,
    files: tuple[str, ...] = ("model.safetensors", "tokenizer.json"),
) -> Path:
    """The cache layout `hf download` leaves: refs/main and snapshots/<sha>/ holding config.json
    and `files` (plain files where the cache has links to its blobs: pipe reads either)."""
    folder = tmp_path / "hf" / "hub" / "--".join(["models", *repo.split("/")])
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(sha)
    return release(folder / "snapshots" / sha, files)


def test_offline_the_cache_pins_the_revision_at_validate_and_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # never asked
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    sha = "a" * 40
    _cache(tmp_path, "org/tiny", sha)
    _write(tmp_path, EVALUATE.format(model="org/tiny"))
    assert run_cli("validate", "p.yaml", cwd=tmp_path).exit_code == 0
    stage = _plan(tmp_path)["stages"]["evaluate"]
    assert stage["config"]["checkpoints"] == [f"org/tiny@{sha}"]
    assert stage["hub"][0]["from"] == "the local cache"


def test_offline_an_id_the_cache_lacks_is_refused_at_validate_with_the_download_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _write(tmp_path, EVALUATE.format(model="org/tiny@v1"))
    assert _errors(tmp_path, "validate") == [
        f"p.yaml:5:49: stages.evaluate.config.checkpoints: 'org/tiny@v1' is not in the Hugging "
        f"Face cache ({tmp_path}/cache) and HF_HUB_OFFLINE is set: download it where there is "
        "a network (`hf download org/tiny --revision v1` with the same HF_HOME or "
        "HF_HUB_CACHE), or unset HF_HUB_OFFLINE so that pipe plan asks the hub"
    ]


@pytest.mark.parametrize(
    ("files", "lacks"),
    [
        (("tokenizer.json",), "model.safetensors or pytorch_model.bin"),  # a tokenizer loaded
        (
            ("model.safetensors.index.json", "model-00001-of-00002.safetensors", "tokenizer.json"),
            "model-00002-of-00002.safetensors",
        ),
    ],
)
def test_offline_a_model_the_cache_holds_in_part_is_refused_at_validate_and_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, files: tuple[str, ...], lacks: str
):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    snapshot = _cache(tmp_path, "org/tiny", "a" * 40, files)
    if "model.safetensors.index.json" in files:
        shards = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
        (snapshot / "model.safetensors.index.json").write_text(json.dumps({"weight_map": shards}))
    _write(tmp_path, EVALUATE.format(model="org/tiny"))
    expected = [
        f"p.yaml:5:49: stages.evaluate.config.checkpoints: 'org/tiny' is in the Hugging Face "
        f"cache ({tmp_path}/hf/hub) without {lacks} (a download of some of its files, or of its "
        "tokenizer alone), and HF_HUB_OFFLINE is set: complete it where there is a network "
        "(`hf download org/tiny` with the same HF_HOME or HF_HUB_CACHE), or unset HF_HUB_OFFLINE "
        "so that the run downloads what is missing"
    ]
    assert _errors(tmp_path, "validate") == expected
    assert _errors(tmp_path) == expected


def test_a_dataset_by_hub_id_is_pinned_and_a_moved_main_changes_its_key(
    tmp_path: Path, hub: FakeHub
):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    sha = hub.add("org/data", data, repo_type="dataset")
    _write(tmp_path, "data:\n  kind: dataset\n  config: {source: huggingface, path: org/data}\n")
    assert _plan(tmp_path)["stages"]["data"]["config"]["path"] == f"org/data@{sha}"
    before = _key(tmp_path, "data")
    (data / "test.jsonl").write_text('{"prompt": "2+2", "answer": "4"}\n')
    hub.add("org/data", data, repo_type="dataset")
    assert _key(tmp_path, "data") != before


def test_an_openai_backends_model_is_a_served_name_not_a_hub_id(tmp_path: Path, hub: FakeHub):
    backend = "{kind: openai, base_url: 'http://127.0.0.1:9/v1', model: org/tiny}"
    _write(
        tmp_path,
        f"collect:\n  kind: collect\n  config: {{input: prompts.jsonl, backend: {backend}}}\n",
    )
    assert _plan(tmp_path)["stages"]["collect"]["config"]["backend"]["model"] == "org/tiny"
    assert hub.requests == []


def test_a_download_shows_a_progress_bar_where_hugging_faces_bars_are_off(
    hub: FakeHub, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """Workers set HF_HUB_DISABLE_PROGRESS_BARS (transformers' loading bars stay out of the
    run's output); a model's download still shows its bar, and a second fetch reads the cache."""
    import importlib

    from engine.hub import fetch

    hub_tqdm = importlib.import_module("huggingface_hub.utils.tqdm")
    monkeypatch.setattr(hub_tqdm, "HF_HUB_DISABLE_PROGRESS_BARS", True)
    assert hub_tqdm.are_progress_bars_disabled()  # as on a worker
    folder = fetch("org/tiny@main")
    assert (Path(folder) / "config.json").is_file()
    bar = capfd.readouterr().err
    assert "Downloading bytes" in bar and "100%" in bar
    assert fetch("org/tiny@main") == folder  # from the cache: no bar
    assert "Downloading bytes" not in capfd.readouterr().err


def _weights_got(hub: FakeHub) -> list[str]:
    return [p for m, p, _ in hub.requests if m == "GET" and p.endswith("/model.safetensors")]


def test_online_a_snapshot_holding_only_the_config_is_completed(hub: FakeHub):
    """`hf download org/tiny config.json` leaves the commit's snapshot folder with one file."""
    from huggingface_hub import hf_hub_download

    from engine.hub import fetch, hub_cache

    sha = hub.repos["model", "org/tiny"].refs["main"]
    hf_hub_download(
        "org/tiny", "config.json", revision=sha, cache_dir=hub_cache(), endpoint=hub.url
    )
    folder = Path(fetch(f"org/tiny@{sha}"))
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    assert len(_weights_got(hub)) == 1


def test_two_workers_racing_for_one_model_make_one_download_and_see_it_whole(hub: FakeHub):
    """The weights arrive a second after the config: the worker that waits does not take the
    snapshot folder half filled, and downloads nothing itself."""
    import glob
    import threading
    import time

    from engine.hub import fetch, hub_cache

    hub.slow["model.safetensors"] = 1.0
    seen: list[tuple[str, bool]] = []

    def worker() -> None:
        folder = fetch("org/tiny@main")
        seen.append((folder, (Path(folder) / "model.safetensors").is_file()))

    threads = [threading.Thread(target=worker) for _ in range(2)]
    threads[0].start()
    config = hub_cache() + "/models--org--tiny/snapshots/*/config.json"
    deadline = time.monotonic() + 10
    while not glob.glob(config) and time.monotonic() < deadline:  # the download under way
        time.sleep(0.02)
    threads[1].start()
    for t in threads:
        t.join(timeout=30)
    assert len(seen) == 2 and seen[0] == seen[1] and seen[0][1]
    assert len(_weights_got(hub)) == 1


def test_what_a_snapshot_lacks(tmp_path: Path):
    """Shards without their index are no checkpoint; a tokenizer is asked for unless the
    listing of the commit's files huggingface_hub keeps (`trees/<sha>.json`) shows none."""
    from engine.hub_files import missing

    snapshot = release(tmp_path / "snapshots" / "s", ("model-00001-of-00002.safetensors",))
    assert missing(str(snapshot)) == [
        "model.safetensors.index.json",
        "tokenizer.json or tokenizer.model",
    ]
    (tmp_path / "trees").mkdir()
    (tmp_path / "trees" / "s.json").write_text(json.dumps({"files": {"config.json": {}}}))
    assert missing(str(snapshot)) == ["model.safetensors.index.json"]
    assert missing(str(release(tmp_path / "snapshots" / "s", ("model.safetensors",)))) == []
