"""Cache keys of external inputs: a checkpoint folder is keyed by its files (names, sizes,
mtimes, the bytes of the small ones), not by the folder's own size and mtime."""

from __future__ import annotations

import os
from pathlib import Path

from engine.fsio import SMALL, folder_key
from engine.plan.checksums import HashCache

WEIGHTS = b"\x01" * (SMALL + 10)  # over the hashing limit, as real weights are


def checkpoint(folder: Path) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text('{"vocab_size": 300}\n')
    (folder / "model.safetensors").write_bytes(WEIGHTS)
    return folder


def rewrite_in_place(file: Path, data: bytes, mtime_ns: int) -> None:
    """Overwrite the bytes of an existing file (the folder's own mtime stays), then set mtime."""
    with open(file, "r+b") as f:
        f.write(data)
    os.utime(file, ns=(mtime_ns, mtime_ns))


def test_weights_rewritten_in_place_change_the_key_the_folder_mtime_does_not(tmp_path: Path):
    ckpt = checkpoint(tmp_path / "ckpt")
    hashes = HashCache(str(tmp_path / ".pipe-hashes.json"))
    before, folder_stat = hashes.get(str(ckpt)), os.stat(ckpt)
    weights = ckpt / "model.safetensors"
    rewrite_in_place(weights, b"\x02" * len(WEIGHTS), os.stat(weights).st_mtime_ns + 1_000_000)
    assert os.stat(ckpt).st_mtime_ns == folder_stat.st_mtime_ns  # what the old key looked at
    assert os.stat(weights).st_size == len(WEIGHTS)
    assert hashes.get(str(ckpt)) != before
    assert HashCache(str(tmp_path / ".pipe-hashes.json")).get(str(ckpt)) != before  # saved or not


def test_a_small_file_edited_at_the_same_size_and_mtime_changes_the_key(tmp_path: Path):
    ckpt = checkpoint(tmp_path / "ckpt")
    before = folder_key(str(ckpt))
    config = ckpt / "config.json"
    same = os.stat(config).st_mtime_ns
    rewrite_in_place(config, b'{"vocab_size": 301}\n', same)
    assert os.stat(config).st_mtime_ns == same and os.stat(config).st_size == 20
    assert folder_key(str(ckpt)) != before


def test_large_files_are_not_read_only_their_size_and_mtime_count(tmp_path: Path):
    ckpt = checkpoint(tmp_path / "ckpt")
    before = folder_key(str(ckpt))
    weights = ckpt / "model.safetensors"
    rewrite_in_place(weights, b"\x02" * len(WEIGHTS), os.stat(weights).st_mtime_ns)
    assert folder_key(str(ckpt)) == before  # the documented trade: multi-GB weights unread


def test_added_renamed_and_removed_files_change_the_key(tmp_path: Path):
    ckpt = checkpoint(tmp_path / "ckpt")
    keys = [folder_key(str(ckpt))]
    (ckpt / "sub").mkdir()
    (ckpt / "sub" / "tokenizer.json").write_text("{}")
    keys.append(folder_key(str(ckpt)))
    (ckpt / "sub" / "tokenizer.json").rename(ckpt / "sub" / "tok.json")
    keys.append(folder_key(str(ckpt)))
    (ckpt / "sub" / "tok.json").unlink()
    keys.append(folder_key(str(ckpt)))
    assert len(set(keys)) == 3 and keys[0] == keys[3]  # an empty folder adds nothing


def test_download_bookkeeping_leaves_the_key_alone(tmp_path: Path):
    ckpt = checkpoint(tmp_path / "ckpt")
    before = folder_key(str(ckpt))
    (ckpt / ".cache" / "huggingface" / "download").mkdir(parents=True)
    (ckpt / ".cache" / "huggingface" / "download" / "model.safetensors.metadata").write_text("x")
    (ckpt / "model.safetensors.lock").write_text("")
    assert folder_key(str(ckpt)) == before


def test_local_paths_and_file_urls_give_the_same_key(tmp_path: Path):
    ckpt = checkpoint(tmp_path / "ckpt")
    assert folder_key(f"file://{ckpt}") == folder_key(str(ckpt))


def test_a_remote_folder_is_keyed_by_its_files(tmp_path: Path):
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.pipe({"/ckpt/config.json": b'{"a": 1}', "/ckpt/model.safetensors": WEIGHTS})
    before = folder_key("memory://ckpt")
    fs.pipe("/ckpt/config.json", b'{"a": 2}')
    assert folder_key("memory://ckpt") != before
