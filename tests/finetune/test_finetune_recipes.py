"""docs/finetune.md's CPU recipe, run as written (2 steps instead of 100, in a temporary folder): it writes the
clips, fine-tunes the embedded softmax teacher to MHLA and generates from the saved pipeline with no other flag."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.finetune import subprocess_env

REPO = Path(__file__).resolve().parents[2]


def _recipe() -> list[str]:
    """The recipe's commands, one per line (backslash continuations joined)."""
    page = (REPO / "docs" / "finetune.md").read_text()
    block = re.search(r"<!-- cpu-recipe -->\n```bash\n(.*?)```\n<!-- /cpu-recipe -->", page, re.DOTALL).group(1)
    return [line for line in block.replace("\\\n", " ").splitlines() if line.strip()]


@pytest.mark.slow
def test_the_cpu_recipe_fine_tunes_the_embedded_model_and_generates(tmp_path):
    commands = _recipe()
    assert [c.split()[0] for c in commands] == ["python", "python", "mhla"]
    assert "--max_train_steps 100" in commands[1]
    assert "write_shapes_dataset('runs/shapes-data', 240)" in commands[0]
    for command in commands:
        # 2 steps on 16 clips: the whole chain, without encoding 240 clips' latents for 2 steps
        command = command.replace("--max_train_steps 100", "--max_train_steps 2").replace("data', 240)", "data', 16)")
        for folder in ("runs/", "outputs/"):  # outputs into the temporary folder
            command = command.replace(f"'{folder}", f"'{tmp_path}/{folder}").replace(
                f" {folder}", f" {tmp_path}/{folder}"
            )
        command = re.sub(r"^python ", f"{sys.executable} ", command)
        command = re.sub(r"^mhla ", f"{sys.executable} -m mhla_diffusion.cli ", command)
        done = subprocess.run(command, shell=True, cwd=REPO, env=subprocess_env(), capture_output=True, text=True)
        assert done.returncode == 0, f"{command}\n{done.stderr[-3000:]}"

    assert len((tmp_path / "runs" / "shapes-data" / "metadata.jsonl").read_text().splitlines()) == 16
    index = json.loads((tmp_path / "runs" / "shapes-mhla" / "pipeline" / "model_index.json").read_text())
    assert index["transformer"] == ["mhla_diffusion", "MHLAWanTransformer3DModel"]
    (sidecar,) = (tmp_path / "outputs" / "shapes").glob("*.json")
    settings = json.loads(sidecar.read_text())
    assert (settings["num_frames"], settings["height"], settings["width"]) == (9, 48, 48)
    assert (settings["guidance_scale"], settings["flow_shift"], settings["attention"]) == (2.0, 12.0, "mhla")


@pytest.mark.slow  # asks git
def test_the_cpu_recipe_writes_only_into_folders_git_ignores():
    """Run from a checkout, the recipe leaves no untracked files: every folder it writes is ignored."""
    text = " ".join(_recipe())
    written = re.findall(r"write_shapes_dataset\('([^']+)'", text) + re.findall(r"--output[_-]dir (\S+)", text)
    assert len(written) == 3, written
    for path in written:
        ignored = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=REPO)
        assert ignored.returncode == 0, f"{path} is not ignored by .gitignore"
