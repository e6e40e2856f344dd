"""Context-parallel MHLA on CPU processes (gloo): P processes give the one-process result.

Every process compares its share with the one-process computation it also runs (see
:mod:`helpers.context_parallel`); gradients of parameters are summed over the processes first.
Tolerance: 1e-5 absolute for values up to 1 in magnitude, relative beyond (fp32 throughout).
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from helpers.cli import text_to_video
from helpers.context_parallel import LEPE_GRIDS, OPERATOR_CASES, TRANSFORMER_CASES, training_gradients
from helpers.finetune import wan_options
from mhla_diffusion.models.context_parallel import enable_context_parallel, run_cpu_processes, training_layout
from mhla_diffusion.models.tiny import tiny_wan_transformer
from mhla_diffusion.utils.sequence_split import split_sizes

TOLERANCE = 1e-5
WORLD_SIZES = [2, 3]


def assert_close(compared: dict[str, tuple[float, float]], where: str) -> None:
    bad = {name: diff for name, (diff, scale) in compared.items() if not diff <= TOLERANCE * max(1.0, scale)}
    assert not bad, f"{where}: differs from one process: {bad}"


@pytest.mark.slow
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("case", sorted(OPERATOR_CASES) + [f"lepe: {name}" for name in LEPE_GRIDS])
def test_operator_matches_one_process(parallel_results, world_size, case):
    """Forward and gradients of every q, k, v (RoPE'd ones too) and the mixing, every normalisation."""
    key = case if case.startswith("lepe: ") else f"operator: {case}"
    for rank, results in enumerate(parallel_results(world_size)):
        compared = results["operator"][key]
        assert "output" in compared and any(name.startswith("grad") for name in compared)
        assert_close(compared, f"rank {rank} of {world_size}, {case}")


@pytest.mark.slow
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("case", sorted(TRANSFORMER_CASES))
def test_tiny_wan_matches_one_process(parallel_results, world_size, case):
    """Output (gathered on every rank) and training gradients of a tiny converted Wan transformer."""
    uneven = TRANSFORMER_CASES[case]["split"] == "uneven"
    for rank, results in enumerate(parallel_results(world_size)):
        result = results["transformer"][case]
        assert (result["tokens"] % world_size != 0) == uneven, result["tokens"]
        assert result["gradients in one run only"] == []
        if TRANSFORMER_CASES[case]["grads"]:
            grads = [name for name in result["compared"] if name.startswith("grad ")]
            assert any(".processor.mixing" in name for name in grads) and any(
                "patch_embedding" in name for name in grads
            )
        assert_close(result["compared"], f"rank {rank} of {world_size}, {case}")


@pytest.mark.slow
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_refusals_name_the_problem_and_the_fix(parallel_results, world_size):
    messages = parallel_results(world_size)[0]["refusals"]
    assert "must equal the number of processes" in messages["degree is not the world size"]
    assert f"--nproc_per_node {world_size + 1}" in messages["degree is not the world size"]
    assert (
        "ring attention" in messages["ring softmax layers on CPU"]
        and "ulysses_degree" in messages["ring softmax layers on CPU"]
    )
    assert "already enabled" in messages["enabled twice"]
    uneven = messages["uneven token count, even split"]
    assert "do not split evenly" in uneven and "ulysses_anything=True" in uneven


def test_without_a_process_group_the_error_says_how_to_start_one():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="torchrun --nproc_per_node"):
        enable_context_parallel(tiny_wan_transformer(num_layers=1), 2)


def test_split_sizes_follow_diffusers_rules():
    assert split_sizes(70, 3, even=False) == (24, 23, 23)  # torch.tensor_split
    assert split_sizes(105, 3, even=True) == (35, 35, 35)  # torch.chunk
    with pytest.raises(ValueError, match="do not split evenly"):
        split_sizes(70, 3, even=True)
    with pytest.raises(ValueError, match="at least one token"):
        split_sizes(2, 3, even=False)


@pytest.mark.slow
def test_tiny_pipeline_and_command_line_make_the_one_process_video(parallel_results, parallel_output_dir):
    """``torchrun --nproc_per_node 2 -m mhla_diffusion.cli text-to-video --context-parallel 2``, in-process:
    the same frames as one process, written by rank 0 alone, the degree in the settings."""
    import json

    import imageio.v3 as iio
    import numpy as np

    ranks = parallel_results(2)
    for rank, results in enumerate(ranks):
        run = results["pipeline"]
        assert_close({"pipeline frames": run["pipeline"]}, f"rank {rank}")
        assert run["exit code"] == 0 and run["mismatched degree"] == 2
        assert ("[1/1]" in run["printed"]) == (rank == 0), run["printed"]  # only rank 0 writes and reports
    assert ranks[0]["pipeline"]["one-process exit code"] == 0

    one, split = (sorted((parallel_output_dir / name).glob("*.json")) for name in ("one", "split"))
    assert len(one) == len(split) == 1 and one[0].name == split[0].name
    settings = json.loads(split[0].read_text())
    assert settings["context_parallel"] == 2 and json.loads(one[0].read_text())["context_parallel"] == 1
    frames = [
        np.stack([iio.imread(f) for f in sorted(path.with_suffix("").glob("*.png"))]).astype(int)
        for path in (one[0], split[0])
    ]
    assert frames[0].shape == frames[1].shape == (9, 32, 48, 3)
    assert np.abs(frames[0] - frames[1]).max() <= 1  # uint8 frames of float results equal within 1e-5


@pytest.mark.slow
def test_training_on_a_2x2_mesh_gives_the_data_parallel_gradient():
    """4 processes: 2 data-parallel groups x 2 context-parallel ranks (DDP over all 4, the trainer's loss
    scale) give every process the mean over the 2 batches of the one-process gradient."""
    ranks = run_cpu_processes(training_gradients, 4, timeout=300)
    assert [r["layout"] for r in ranks] == [(2, 0, 2), (2, 0, 2), (2, 1, 2), (2, 1, 2)]
    for rank, result in enumerate(ranks):
        assert result["missing"] == [] and len(result["compared"]) > 100
        assert_close(result["compared"], f"rank {rank} of 4")


def test_trainer_option_context_parallel_degree(tmp_path):
    assert wan_options(tmp_path, tmp_path, tmp_path / "run", context_parallel_degree=2).context_parallel_degree == 2
    with pytest.raises(ValueError, match="context_parallel_degree"):
        wan_options(tmp_path, tmp_path, tmp_path / "run", context_parallel_degree=0)
    with pytest.raises(ValueError, match="attention_transfer_steps: 0"):
        wan_options(tmp_path, tmp_path, tmp_path / "run", context_parallel_degree=2, attention_transfer_steps=2)
    assert training_layout(1) == training_layout()  # one process: one data-parallel group of one
    with pytest.raises(ValueError, match="must be an int >= 1"):
        training_layout(0)


@pytest.mark.slow
def test_wan_family_pipelines_make_the_one_process_video(parallel_results):
    """Wan2.1 image-to-video, Wan2.2-TI2V-5B (text and image; per-token timesteps, split with the tokens) and
    Wan2.2-A14B text and image (both transformers split) on 2 processes."""
    for rank, results in enumerate(parallel_results(2)):
        runs = results["wan family"]
        assert len(runs) == 5 and any("(2 transformers)" in name for name in runs)
        assert_close(runs, f"rank {rank} of 2")


@pytest.mark.parametrize(
    "world, flags, message",
    [
        (None, ["--context-parallel", "2"], "one process was launched (no torchrun)"),
        ("3", ["--context-parallel", "2"], "needs 2 processes but 3 were launched"),
        ("2", [], "pass --context-parallel 2"),
        ("2", ["--context-parallel", "2", "--height", "48", "--width", "48"], "27 tokens do not split evenly"),
    ],
)
def test_command_line_refuses_before_loading(pipeline_dirs, tmp_path, monkeypatch, capsys, world, flags, message):
    """Degree against the launch (WORLD_SIZE) and the video's token count against the split, checked on every
    process before anything loads (no process group is started: none exists in this test process)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    if world is not None:
        monkeypatch.setenv("WORLD_SIZE", world)
    code = text_to_video(pipeline_dirs, tmp_path, "--prompt", "a red circle", *flags)
    assert code == 2 and message in capsys.readouterr().err
    assert not dist.is_initialized() and not list(tmp_path.iterdir())
