"""Reloading folders saved by our pipelines with Diffusers' stock loaders, in a fresh process.

Diffusers (0.42) resolves a component library named in ``model_index.json`` only from ``sys.modules``:
it imports no module a folder names and reads no entry points. So a folder whose transformer is an
``mhla_diffusion`` class loads with stock ``DiffusionPipeline.from_pretrained`` only after
``import mhla_diffusion``; before it, Diffusers' error tells the user to import it, and the folder's
``model_index.json`` says the same.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import mhla_diffusion
from helpers.finetune import subprocess_env
from mhla_diffusion.pipelines import MHLADiTPipeline, MHLAWanPipeline
from mhla_diffusion.pipelines.mhla_mixin import LOAD_HINT_KEY

# Loads the folder with the stock DiffusionPipeline before and after `import mhla_diffusion`; prints JSON.
_SCRIPT = textwrap.dedent("""
    import json, sys
    from diffusers import DiffusionPipeline
    folder = sys.argv[1]
    result = {"imported_before": "mhla_diffusion" in sys.modules}
    try:
        DiffusionPipeline.from_pretrained(folder)
        result["without_import"] = "loaded"
    except ValueError as error:
        result["without_import"] = str(error)
    import mhla_diffusion
    from mhla_diffusion.models.conversion import get_mhla_conversion
    pipe = DiffusionPipeline.from_pretrained(folder)
    result["pipeline"] = type(pipe).__name__
    result["transformer"] = type(pipe.transformer).__module__.split(".")[0] + "." + type(pipe.transformer).__name__
    result["mhla_layers"] = get_mhla_conversion(pipe.transformer).layers
    result["package"] = mhla_diffusion.__file__
    print(json.dumps(result))
""")


def _stock_load(folder) -> dict:
    # The subprocess imports the same mhla_diffusion as this process (whatever the installed copy points at).
    root = str(Path(mhla_diffusion.__file__).resolve().parents[1])
    env = dict(subprocess_env(), PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(folder)], capture_output=True, text=True, env=env, cwd=root, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(result["package"]).resolve().is_relative_to(root), result["package"]
    return result


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["wan", "dit"])
def test_stock_diffusers_reload_needs_import_and_says_so(kind, pipeline_dirs, tmp_path):
    cls = MHLAWanPipeline if kind == "wan" else MHLADiTPipeline
    saved = tmp_path / "saved"
    cls.from_pretrained(pipeline_dirs[kind], mhla_weights=pipeline_dirs[f"{kind}_mhla"]).save_pretrained(saved)
    index = json.loads((saved / "model_index.json").read_text())
    assert index["transformer"][0] == "mhla_diffusion"
    # The folder itself says what to import (Diffusers ignores "_" keys).
    assert "import mhla_diffusion" in index[LOAD_HINT_KEY]

    result = _stock_load(saved)
    assert result["imported_before"] is False
    # Without the import Diffusers refuses, and its message names the import to run.
    assert "mhla_diffusion is not one of the libraries" in result["without_import"]
    assert "import mhla_diffusion before calling `from_pretrained`" in result["without_import"]
    # After `import mhla_diffusion` (in the same process) the stock loader restores MHLA.
    assert result["pipeline"] == ("WanPipeline" if kind == "wan" else "DiTPipeline")
    assert result["transformer"].startswith("mhla_diffusion.MHLA")
    assert result["mhla_layers"]


def test_softmax_folder_has_no_load_hint(pipeline_dirs, tmp_path):
    MHLADiTPipeline.from_pretrained(pipeline_dirs["dit"]).save_pretrained(tmp_path / "plain")
    index = json.loads((tmp_path / "plain" / "model_index.json").read_text())
    assert index["transformer"][0] == "diffusers" and LOAD_HINT_KEY not in index
