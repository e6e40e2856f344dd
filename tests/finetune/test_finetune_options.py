"""Trainer options: YAML + command-line overrides, type checks, reference-recipe defaults."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from mhla_diffusion.finetune.options import DiTTrainOptions, WanTrainOptions, load_options, options_from_dict

REQUIRED = dict(pretrained_model="model", data_dir="data", output_dir="out")


def test_yaml_then_cli_overrides(tmp_path):
    config = tmp_path / "wan.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                **REQUIRED,
                "max_train_steps": 10,
                "mhla": {"layers": "hybrid", "gate": True},
                "resolution_buckets": [[480, 832], [480, 480]],
            }
        )
    )
    options = load_options(
        WanTrainOptions,
        [
            "--config",
            str(config),
            "--max-train-steps",
            "25",
            "--learning_rate=1e-4",
            "--mhla.layout",
            "[3, 5, 10]",
            "--gradient_checkpointing",
            "false",
            "--validation_prompts",
            '["a cat", "a dog"]',
            "--mixed_precision",
            "no",
        ],
    )
    assert options.mixed_precision == "no"  # not YAML's boolean false
    assert options.max_train_steps == 25 and options.learning_rate == 1e-4
    assert options.mhla == {"layers": "hybrid", "gate": True, "layout": [3, 5, 10]}
    assert options.gradient_checkpointing is False
    assert options.validation_prompts == ["a cat", "a dog"]
    assert options.bucket_sizes() == [(480, 832), (480, 480)]


def test_reference_recipe_defaults():
    wan = options_from_dict(WanTrainOptions, REQUIRED)
    assert (wan.learning_rate, wan.adam_beta1, wan.adam_beta2, wan.adam_epsilon, wan.weight_decay) == (
        2e-5,
        0.9,
        0.999,
        1e-10,
        0.0,
    )
    assert (wan.lr_scheduler, wan.max_grad_norm, wan.mixed_precision) == ("constant_with_warmup", 0.1, "bf16")
    assert (wan.logit_mean, wan.logit_std, wan.flow_shift, wan.caption_dropout) == (0.0, 1.0, 3.0, 0.1)
    assert wan.gradient_checkpointing and wan.num_frames == 81 and wan.train_batch_size == 4
    assert (wan.ema_decay, wan.distillation_weight) == (0.0, 0.0)  # neither is part of the reference recipe
    dit = options_from_dict(DiTTrainOptions, REQUIRED)
    assert (dit.learning_rate, dit.lr_scheduler, dit.max_grad_norm, dit.ema_decay) == (1e-4, "constant", 0.0, 0.9999)
    assert dit.clamp_mixing and dit.class_dropout == 0.1 and dit.learned_sigma_loss == "vb"


@pytest.mark.parametrize(
    "values, message",
    [
        ({"max_train_stepz": 3}, "did you mean `max_train_steps`"),
        ({"max_train_steps": "many"}, "`max_train_steps` must be an integer"),
        ({"gradient_checkpointing": "yes"}, "must be true or false"),
        ({"num_frames": 0}, "`num_frames` must be >= 1"),  # the model's frame rule: checked by the trainer
        ({"resolution_buckets": [[480]]}, "must be [height, width]"),
        ({"trainable": "some"}, "`trainable` must be one of"),
        ({"output_dir": ""}, "`output_dir` is required"),
        ({"resume": "latest", "overwrite_output_dir": True}, "choose one"),
        ({"cache_latents": True, "frame_sampling": "random"}, "frame_sampling: start"),
    ],
)
def test_bad_options_name_the_problem(values, message):
    with pytest.raises(ValueError, match=message.replace("+", r"\+").replace("[", r"\[")):
        options_from_dict(WanTrainOptions, {**REQUIRED, **values})


@pytest.mark.parametrize(
    "cls, values, message",
    [
        (WanTrainOptions, {"attention": "linear"}, "`attention` must be one of mhla, softmax"),
        (WanTrainOptions, {"mhla": {"layers": "hybrid"}}, "`mhla` is set"),
        (DiTTrainOptions, {"mhla_preset": "released-wan"}, "`mhla_preset` is set"),
        (WanTrainOptions, {"mhla_weights": "w"}, "`mhla_weights` is set"),
        (DiTTrainOptions, {"attention_transfer_steps": 10}, "attention_transfer_steps: 0"),
        (WanTrainOptions, {"trainable": "mhla"}, "trains `trainable: all or lora`"),
        (WanTrainOptions, {"trainable": "attention"}, "trains `trainable: all or lora`"),
        (DiTTrainOptions, {"trainable": "attention"}, "trains `trainable: all`"),
    ],
)
def test_softmax_runs_take_no_mhla_options(cls, values, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        options_from_dict(cls, {**REQUIRED, "attention": "softmax", **values})
    assert options_from_dict(cls, {**REQUIRED, "attention": "softmax"}).attention == "softmax"
    assert options_from_dict(cls, REQUIRED).attention == "mhla"


def test_dit_has_no_lora():
    with pytest.raises(ValueError, match="`trainable` must be one of all, mhla, attention"):
        options_from_dict(DiTTrainOptions, {**REQUIRED, "trainable": "lora"})


def test_cli_needs_values_and_a_real_config(tmp_path):
    with pytest.raises(ValueError, match="needs a value"):
        load_options(WanTrainOptions, ["--max_train_steps"])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_options(WanTrainOptions, ["--config", str(tmp_path / "missing.yaml")])


@pytest.mark.parametrize(
    "name",
    [
        "wan2.1_t2v_1.3b_mhla.yaml",
        "wan2.1_t2v_1.3b_mhla_released.yaml",
        "dit_xl2_256_mhla.yaml",
        *(
            f"dit_s2_256_from_scratch_{attention}.yaml"
            for attention in ("softmax", "mhla", "linear", "mhla_lepe_gate", "released_dit")
        ),
    ],
)
def test_example_configs_are_valid(name):
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "finetune" / "configs" / name  # the repository's example configs
    cls = DiTTrainOptions if name.startswith("dit") else WanTrainOptions
    options = load_options(cls, ["--config", str(path)])
    if "from_scratch" in name:  # the released DiT recipe from random initialisation
        assert (options.model_size, options.pretrained_model, options.vae_model) == (
            "DiT-S/2",
            "",
            "stabilityai/sd-vae-ft-ema",
        )
        assert (
            options.learning_rate,
            options.lr_scheduler,
            options.lr_warmup_steps,
            options.weight_decay,
            options.max_grad_norm,
        ) == (1e-4, "constant", 0, 0.0, 0.0)
        assert (options.ema_decay, options.class_dropout, options.train_batch_size * 8) == (0.9999, 0.1, 256)
        assert options.flip_coin_per_batch and options.cache_latents and options.latent_sampling == "presampled"
        assert options.clamp_mixing
    else:
        assert options.pretrained_model in ("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "facebook/DiT-XL-2-256")


@pytest.mark.parametrize("cls", [WanTrainOptions, DiTTrainOptions])
def test_every_option_has_help_and_help_shows_it(cls, capsys, monkeypatch):
    """The help text of each option is its field's definition, and `--help` prints it."""
    from mhla_diffusion.utils.options import field_help

    monkeypatch.setenv("COLUMNS", "100000")  # no wrapping: each option's help on its line
    with pytest.raises(SystemExit) as stop:
        load_options(cls, ["--help"])
    assert stop.value.code == 0
    text = capsys.readouterr().out
    for f in dataclasses.fields(cls):
        assert field_help(cls, f.name).strip(), f"{cls.__name__}.{f.name} has no help"
        assert f"--{f.name} VALUE" in text and field_help(cls, f.name) in text, f.name
    trainable = "all, mhla, attention, lora" if cls is WanTrainOptions else "all, mhla, attention"  # DiT: no LoRA
    assert f"(one of {trainable}; default: 'all')" in text


def test_command_line_names_and_values_are_checked_before_anything_loads():
    with pytest.raises(ValueError, match=r"unknown option `mhla.layot` \(did you mean `mhla.layout`\?\)"):
        load_options(WanTrainOptions, ["--mhla.layot", "[3, 5, 10]"])
    with pytest.raises(ValueError, match=r"unknown option `learnin_rate` \(did you mean `learning_rate`\?\)"):
        load_options(WanTrainOptions, ["--learnin_rate", "1e-4"])
    with pytest.raises(ValueError, match="`gradient_checkpointing` must be true or false, got 'no'"):
        load_options(WanTrainOptions, ["--gradient_checkpointing", "no"])
    options = load_options(
        WanTrainOptions,
        [f"--{k}={v}" for k, v in REQUIRED.items()]
        + ["--lora_target_modules", "to_q,to_k", "--revision", "010", "--resume", "none"],
    )
    assert options.lora_target_modules == ["to_q", "to_k"] and options.revision == "010" and options.resume is None


@pytest.mark.parametrize("text", ["1,6,6", "1, 6, 6", "1x6x6", "[1, 6, 6]"])
def test_mhla_list_options_take_the_one_list_rule(text):
    """`--mhla.layout 1,6,6` is a list like `--frame_buckets 9,17` (issue 44: it stayed the string '1,6,6')."""
    options = load_options(WanTrainOptions, [*(f"--{k}={v}" for k, v in REQUIRED.items()), "--mhla.layout", text])
    assert options.mhla == {"layout": [1, 6, 6]}
    assert options.mhla_config().layout == (1, 6, 6)
    layers = load_options(WanTrainOptions, [*(f"--{k}={v}" for k, v in REQUIRED.items()), "--mhla.layers", "1,2"])
    assert layers.mhla == {"layers": [1, 2]}
    from_file = options_from_dict(WanTrainOptions, {**REQUIRED, "mhla": {"layout": "1,6,6", "target_grid": "3x6x6"}})
    assert from_file.mhla == {"layout": [1, 6, 6], "target_grid": [3, 6, 6]}  # a YAML string by the same rule


def test_list_options_read_alike_everywhere():
    """Every list field takes commas, brackets and (numbers) x; a list of sizes is 480x832,720x1280."""
    args = [f"--{k}={v}" for k, v in REQUIRED.items()]
    buckets = load_options(
        WanTrainOptions, [*args, "--resolution_buckets", "480x832,720x1280", "--frame_buckets", "9x17"]
    )
    assert buckets.bucket_sizes() == [(480, 832), (720, 1280)] and buckets.frame_counts() == [9, 17]
    assert load_options(WanTrainOptions, [*args, "--resolution_buckets", "[[480, 832]]"]).bucket_sizes() == [(480, 832)]
    with pytest.raises(ValueError, match=r"`resolution_buckets` must be a list of sizes such as 480x832,720x1280"):
        load_options(WanTrainOptions, [*args, "--resolution_buckets", "480,832"])


@pytest.mark.slow  # starts a fresh interpreter
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--mhla.layout", "1,a,6"], "`mhla.layout` must be a list of integers such as 3,5,10 (or 3x5x10) or 'auto'"),
        (["--mhla.layout", "0,6,6"], "`mhla.layout` must be >= 1, got [0, 6, 6]"),
        (["--mhla.transform", "spline"], "mhla: unknown `transform` 'spline'"),
        (["--mhla.layers", "some"], "`mhla.layers` must be 'all' or 'hybrid' or a list of integers"),
    ],
)
def test_mhla_option_errors_are_one_line_before_torch(argv, message):
    """The trainer's entry point refuses a bad MHLA option in one line, without importing torch (it took ~18 s
    and then failed inside MHLAConfig)."""
    import json
    import subprocess
    import sys

    script = (
        "import json, sys\nfrom mhla_diffusion.finetune.entry import main\n"
        f"code = main('wan', {[*(f'--{k}={v}' for k, v in REQUIRED.items()), *argv]!r})\n"
        "print(json.dumps({'code': code, 'torch': 'torch' in sys.modules}))"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert json.loads(result.stdout.splitlines()[-1]) == {"code": 2, "torch": False}, result.stderr[-2000:]
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr


def test_errors_under_accelerate_launch_say_how_to_drop_the_launcher_traceback(monkeypatch, capsys):
    from mhla_diffusion.finetune.entry import main

    for name in ("ACCELERATE_MIXED_PRECISION", "ACCELERATE_DYNAMO_BACKEND"):
        monkeypatch.setenv(name, "no")
    assert main("wan", ["--mhla.layout", "1,a,6"]) == 2
    line = capsys.readouterr().err
    assert line.count("\n") == 1 and "`mhla.layout` must be" in line and "`accelerate launch -q`" in line


@pytest.mark.slow  # starts accelerate's launcher and the trainer
def test_an_option_error_under_accelerate_launch_is_one_line(tmp_path):
    """`accelerate launch -q` (the docs' advice, which the error line repeats) shows the trainer's one line and no
    CalledProcessError traceback."""
    import os
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[2] / "finetune" / "train_wan.py"
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "-q", "--cpu", "--num_processes", "1"]
    launcher += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    launcher += ["--num_cpu_threads_per_process", "1"]
    args = [*(f"--{k}={v}" for k, v in REQUIRED.items()), "--mhla.layout", "1,a,6"]
    env = {**os.environ, "ACCELERATE_USE_CPU": "1"}
    result = subprocess.run([*launcher, str(script), *args], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr and "CalledProcessError" not in result.stderr, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "`mhla.layout` must be a list of integers" in errors[0]
    assert "`accelerate launch -q`" in errors[0]


def test_warmup_longer_than_the_run_warns(caplog):
    """The default 1,000 warmup steps in a 40-step run train at 4 % of the learning rate: say so (issue 44)."""
    with caplog.at_level("WARNING", logger="mhla_diffusion.finetune.options"):
        options_from_dict(WanTrainOptions, {**REQUIRED, "max_train_steps": 40, "learning_rate": 2e-4})
    assert "lr_warmup_steps (1000) is longer than the run (max_train_steps 40)" in caplog.text
    assert "only reaches 8e-06 of the 0.0002 asked for" in caplog.text and "--lr_warmup_steps" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="mhla_diffusion.finetune.options"):
        options_from_dict(WanTrainOptions, {**REQUIRED, "max_train_steps": 40, "lr_warmup_steps": 4})
        options_from_dict(WanTrainOptions, {**REQUIRED, "max_train_steps": 40, "lr_scheduler": "constant"})
    assert "lr_warmup_steps" not in caplog.text


@pytest.mark.parametrize("script", ["train_wan", "train_dit"])
def test_trainer_usage_names_the_command_that_was_run(script, capsys, monkeypatch):
    """`python finetune/train_wan.py --help` showed the usage `python -m mhla_diffusion.finetune.train_wan`."""
    import mhla_diffusion.finetune.options as trainer_options

    cls = WanTrainOptions if script == "train_wan" else DiTTrainOptions
    package_module = str(Path(trainer_options.__file__).with_name(f"{script}.py"))
    for argv0, usage in [
        (f"finetune/{script}.py", f"usage: python finetune/{script}.py [--config"),
        (package_module, f"usage: python -m mhla_diffusion.finetune.{script} [--config"),
    ]:
        monkeypatch.setattr("sys.argv", [argv0, "--help"])
        with pytest.raises(SystemExit):
            load_options(cls, ["--help"])
        assert capsys.readouterr().out.startswith(usage)
