"""The one local-path-vs-hub-id rule (:func:`mhla_diffusion.utils.model_source.source_kind`) and the two loaders
that decide with it: ``check_model_source`` (before anything loads) and ``find_file`` (reading a weight folder)."""

from __future__ import annotations

import pytest

from mhla_diffusion.loaders.loading import ModelUnavailable, check_model_source
from mhla_diffusion.loaders.plan import find_file
from mhla_diffusion.utils.model_source import source_kind


def test_source_kind_names_folders_files_missing_paths_and_hub_ids(tmp_path, monkeypatch):
    (tmp_path / "weights.safetensors").write_bytes(b"")
    (tmp_path / "owner" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert source_kind(tmp_path) == source_kind("owner/name") == "folder"  # a local folder wins over a hub id
    assert source_kind(tmp_path / "weights.safetensors") == source_kind("weights.safetensors") == "file"
    for missing in (tmp_path / "nope", "./nope", "~/nope", "nope", "a/b/c", "owner/x/y"):
        assert source_kind(missing) == "missing", missing
    assert source_kind("Wan-AI/Wan2.1-T2V-1.3B-Diffusers") == source_kind("facebook/DiT-XL-2-256") == "hub"


def test_both_loaders_refuse_what_is_not_a_folder_and_leave_hub_ids_to_the_hub(tmp_path):
    file = tmp_path / "weights.safetensors"
    file.write_bytes(b"")
    assert find_file(tmp_path, "weights.safetensors", None, {}) == file
    assert find_file(tmp_path, "other.json", None, {}) is None
    for source, problem in ((file, "is not a folder"), (tmp_path / "nope", "not found")):
        with pytest.raises(FileNotFoundError, match=problem):
            check_model_source(source)
        with pytest.raises(FileNotFoundError, match="neither a local folder nor a hub repo id"):
            find_file(source, "config.json", None, {})
    # a hub id is asked of the hub (its config fetched, or found in the cache): offline and uncached, one line
    offline = r"never-cached-model \(model_index.json or config.json\) could not be fetched: the hub is switched off"
    with pytest.raises(ModelUnavailable, match=offline):
        check_model_source("mhla-tests/never-cached-model")
