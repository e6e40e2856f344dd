"""Fine-tuning reliability: resuming with changed options, metrics after a resume, one run per
folder (the run lock), the process / global-batch log line, non-finite options, the data layouts of
other trainers (DiffSynth-Studio's ``video,prompt`` CSV, finetrainers' ``prompts.txt`` + ``videos.txt``),
and the MHLA mark in LoRA files; one progress bar per run."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys

import pytest
import yaml

from helpers.finetune import Interrupted, crash_at, metrics, wan_options
from mhla_diffusion.finetune import train_dit, train_wan
from mhla_diffusion.finetune.checkpointing import RUN_CONFIG
from mhla_diffusion.finetune.options import WanTrainOptions, options_from_dict
from mhla_diffusion.finetune.video_data import index_video_folder

LOCK_FILE = ".run.lock"  # mhla_diffusion.finetune.checkpointing.LOCK_FILE


LORA = dict(trainable="lora", lora_rank=4, lora_alpha=4, max_train_steps=4, checkpointing_steps=2)


@pytest.mark.slow
def test_resume_refuses_changed_options_and_keeps_the_run_record(tmp_path, pipeline_dirs, video_set):
    base, run = pipeline_dirs["wan"], tmp_path / "run"
    with pytest.raises(Interrupted):
        train_wan.train(wan_options(base, video_set, run, **LORA), on_step_end=crash_at(3))
    record = (run / RUN_CONFIG).read_text()
    with pytest.raises(ValueError, match=r"cannot resume .*trainable: 'lora' -> 'all'"):
        train_wan.train(wan_options(base, video_set, run, resume="latest", **{**LORA, "trainable": "all"}))
    with pytest.raises(
        ValueError, match=r"lora_rank: 4 -> 8.*mhla: \{'layout': \[1, 2, 2\]\} -> \{'layout': \[2, 2, 2\]\}"
    ):
        train_wan.train(
            wan_options(
                base, video_set, run, resume="latest", **{**LORA, "lora_rank": 8, "mhla": {"layout": [2, 2, 2]}}
            )
        )
    assert (run / RUN_CONFIG).read_text() == record  # never rewritten by a refused resume
    # options that may change: run longer, log elsewhere; recorded once the checkpoint loaded
    train_wan.train(
        wan_options(base, video_set, run, resume="latest", **{**LORA, "max_train_steps": 5, "checkpointing_steps": 3})
    )
    recorded = yaml.safe_load((run / RUN_CONFIG).read_text())
    assert recorded["max_train_steps"] == 5 and recorded["checkpointing_steps"] == 3 and recorded["resume"] == "latest"
    assert (run / "final" / "pytorch_lora_weights.safetensors").is_file()


@pytest.mark.slow
def test_metrics_hold_each_step_once_after_a_resume(tmp_path, pipeline_dirs, video_set):
    base, run = pipeline_dirs["wan"], tmp_path / "run"
    with pytest.raises(Interrupted):
        train_wan.train(wan_options(base, video_set, run, **LORA), on_step_end=crash_at(3))
    assert [r["step"] for r in metrics(run) if "loss" in r] == [1, 2, 3]
    train_wan.train(wan_options(base, video_set, run, resume="latest", **LORA))
    assert [r["step"] for r in metrics(run)] == [0, 1, 2, 3, 4]


@pytest.mark.slow
def test_a_live_run_lock_is_refused_naming_its_holder(tmp_path, pipeline_dirs, video_set):
    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        import socket

        (run / LOCK_FILE).write_text(f'{{"host": "{socket.gethostname()}", "pid": {holder.pid}}}\n')
        with pytest.raises(RuntimeError, match=rf"in use by another training run \(process {holder.pid} on this host"):
            train_wan.train(wan_options(pipeline_dirs["wan"], video_set, run, trainable="mhla", max_train_steps=1))
        assert (run / LOCK_FILE).is_file() and not (run / RUN_CONFIG).exists()
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.slow
def test_a_stale_lock_is_taken_over_and_the_start_logs_processes_and_global_batch(
    tmp_path, pipeline_dirs, video_set, caplog
):
    import socket

    run = tmp_path / "run"
    run.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (run / LOCK_FILE).write_text(f'{{"host": "{socket.gethostname()}", "pid": {dead.pid}}}\n')
    caplog.set_level(logging.INFO, logger="mhla_diffusion.finetune")
    train_wan.train(
        wan_options(
            pipeline_dirs["wan"], video_set, run, trainable="mhla", max_train_steps=1, gradient_accumulation_steps=2
        )
    )
    assert f"taking over the stale run lock {run / LOCK_FILE} of process {dead.pid}" in caplog.text
    assert "processes: 1 " in caplog.text
    assert "global batch 4 = 2 per process x 1 processes x 2 accumulation steps" in caplog.text
    assert not (run / LOCK_FILE).exists()  # released at the end


def test_run_lock_unit(tmp_path):
    from mhla_diffusion.finetune.checkpointing import RunLock

    lock = RunLock(tmp_path / "new")
    lock.acquire()
    with pytest.raises(RuntimeError, match="in use by another training run"):
        RunLock(tmp_path / "new").acquire()  # the same (live) process holds it
    lock.release()
    assert not (tmp_path / "new").exists()  # a folder made only for the lock is removed again
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / LOCK_FILE).write_text('{"host": "elsewhere.example", "pid": 1}\n')
    with pytest.raises(RuntimeError, match=r"process 1 on host elsewhere.example.*delete"):
        RunLock(tmp_path / "other").acquire()


@pytest.mark.parametrize(
    "name, value",
    [
        ("learning_rate", "nan"),
        ("learning_rate", float("nan")),
        ("validation_guidance_scale", float("inf")),
        ("logit_std", ".inf"),
        ("max_grad_norm", float("nan")),
    ],
)
def test_non_finite_options_are_refused(tmp_path, name, value):
    values = dict(pretrained_model="x", data_dir="d", output_dir=str(tmp_path), **{name: value})
    with pytest.raises(ValueError, match=rf"`{name}` must be a finite number"):
        options_from_dict(WanTrainOptions, values if value != ".inf" else {**values, name: yaml.safe_load(value)})


@pytest.mark.parametrize("trainer", [train_wan, train_dit])
def test_a_yaml_syntax_error_names_the_file_line_and_column(tmp_path, capsys, trainer):
    config, run = tmp_path / "config.yaml", tmp_path / "run"
    config.write_text(f"output_dir: {run}\nmhla: {{layout: [1, 2\nmax_train_steps: 3\n")  # the list is never closed
    assert trainer.main(["--config", str(config)]) == 2
    assert capsys.readouterr().err == (
        f"error: {config}, line 3, column 16: not valid YAML: expected ',' or ']', but got "
        "':' (while parsing a flow sequence opened at line 2, column 16)\n"
    )
    assert not run.exists()
    assert trainer.main(["--max_train_steps", "[3"]) == 2
    assert capsys.readouterr().err.startswith("error: --max_train_steps '[3', line 1, column 3: not valid YAML:")


def _uncaptioned_copy(video_set, folder):
    shutil.copytree(video_set, folder)
    captions = {}
    for sidecar in folder.glob("*.txt"):
        captions[sidecar.stem] = sidecar.read_text().strip()
        sidecar.unlink()
    return captions


def test_diffsynth_csv_and_finetrainers_txt_layouts(tmp_path, video_set):
    folder = tmp_path / "diffsynth"
    captions = _uncaptioned_copy(video_set, folder)
    names = sorted(p.name for p in folder.iterdir())
    (folder / "metadata.csv").write_text(
        "video,prompt\n" + "".join(f"{n},{captions[n.rsplit('.', 1)[0]]}\n" for n in names)
    )
    samples, _ = index_video_folder(folder, [(32, 32)], [9])
    assert {s.key: s.caption for s in samples} == {n: captions[n.rsplit(".", 1)[0]] for n in names}

    custom = tmp_path / "custom"
    _uncaptioned_copy(video_set, custom)
    (custom / "metadata.csv").write_text(
        "clip,prompt\n" + "".join(f"{n},{captions[n.rsplit('.', 1)[0]]}\n" for n in names)
    )
    with pytest.raises(ValueError, match="no file column `file_name / video / image / path`.*set file_column"):
        index_video_folder(custom, [(32, 32)], [9])
    samples, _ = index_video_folder(custom, [(32, 32)], [9], file_column="clip")
    assert len(samples) == len(names)

    finetrainers = tmp_path / "finetrainers"
    _uncaptioned_copy(video_set, finetrainers)
    media = finetrainers / "media"
    media.mkdir()
    for n in names:
        (finetrainers / n).rename(media / n)
    (finetrainers / "prompts.txt").write_text("".join(captions[n.rsplit(".", 1)[0]] + "\n" for n in names))
    (finetrainers / "videos.txt").write_text("".join(f"media/{n}\n" for n in names))
    samples, _ = index_video_folder(finetrainers, [(32, 32)], [9])
    assert {s.key: s.caption for s in samples} == {f"media/{n}": captions[n.rsplit(".", 1)[0]] for n in names}


def test_hugging_face_datasets_saved_to_disk(tmp_path, video_set):
    import datasets  # in the test extras; optional for users

    folder = tmp_path / "hf"
    captions = _uncaptioned_copy(video_set, folder)
    names = sorted(p.name for p in folder.iterdir())
    table = {"video": names, "prompt": [captions[n.rsplit(".", 1)[0]] for n in names]}
    datasets.Dataset.from_dict(table).save_to_disk(str(folder))
    samples, _ = index_video_folder(folder, [(32, 32)], [9])
    assert {s.key: s.caption for s in samples} == dict(zip(names, table["prompt"]))

    split = tmp_path / "hf-dict"
    _uncaptioned_copy(video_set, split)
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(table)}).save_to_disk(str(split / "."))
    assert len(index_video_folder(split, [(32, 32)], [9])[0]) == len(names)

    embedded = tmp_path / "hf-bytes"
    _uncaptioned_copy(video_set, embedded)
    images = datasets.Dataset.from_dict(
        {"image": [{"path": None, "bytes": b"not a file"}], "text": ["x"]},
        features=datasets.Features({"image": datasets.Image(), "text": datasets.Value("string")}),
    )
    images.save_to_disk(str(embedded))
    with pytest.raises(ValueError, match="holds the media's bytes, not paths"):
        index_video_folder(embedded, [(32, 32)], [9])


@pytest.mark.slow
def test_mhla_lora_files_are_marked_and_refused_without_mhla(tmp_path, pipeline_dirs, video_set):
    from mhla_diffusion.pipelines import MHLAWanPipeline
    from mhla_diffusion.pipelines.lora import read_lora_mark

    base = pipeline_dirs["wan"]
    final = train_wan.train(
        wan_options(base, video_set, tmp_path / "run", trainable="lora", lora_rank=2, max_train_steps=1)
    )
    mark = read_lora_mark(final / "pytorch_lora_weights.safetensors")
    assert mark["requires_mhla"] is True and mark["layout"] == [1, 2, 2] and mark["mhla_layers"]
    softmax = MHLAWanPipeline.from_pretrained(base)
    with pytest.raises(
        ValueError, match="LoRA trained on MHLA layers .* uses softmax attention: load the MHLA weights"
    ):
        softmax.load_lora_weights(final)
    other = MHLAWanPipeline.from_pretrained(base, mhla_weights=pipeline_dirs["wan_mhla"])  # layout (2, 2, 2)
    with pytest.raises(ValueError, match=r"block layout \[1, 2, 2\].*uses \[2, 2, 2\]"):
        other.load_lora_weights(final)
    pipe = MHLAWanPipeline.from_pretrained(base, mhla_weights=final)
    pipe.load_lora_weights(final)  # the matching MHLA model loads it


@pytest.mark.slow
def test_one_progress_bar_relabelled_by_stage(tmp_path, pipeline_dirs, image_classes, capfd):
    """A run shows one bar, labelled by its stage (``transfer`` then ``train``), not a second one."""
    import re

    from helpers.finetune import dit_options
    from mhla_diffusion.finetune import train_dit

    for name, transfer in (("plain", 0), ("transfer", 1)):
        capfd.readouterr()
        train_dit.train(
            dit_options(
                pipeline_dirs["dit"],
                image_classes,
                tmp_path / name,
                max_train_steps=2,
                attention_transfer_steps=transfer,
            )
        )
        renders = re.findall(r"(\w+): +(\d+)%\|", capfd.readouterr().err)  # every draw of a bar: label, percent
        assert [percent for _, percent in renders].count("0") == 1, renders  # main: a "training" bar, then another
        labels = list(dict.fromkeys(label for label, _ in renders))
        assert labels == (["transfer", "train"] if transfer else ["train"]), renders
