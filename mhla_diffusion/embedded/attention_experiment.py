"""``mhla reproduce``: the same DiT trained from random initialisation with each attention, at several
token counts and seeds, scored by the embedded judges: does global linear attention fall behind softmax,
at which token count, and does MHLA close the gap?

Setting: class-to-image on the scikit-learn digits in the latent space of the embedded digits VAE
(``AutoencoderKL``, 2x compression, 4 channels), a ``DiTTransformer2DModel`` with patch 1 and torch's default
initialisation (:func:`_new_model` says why not DiT's). The token count is set by the image size: 256 tokens
= 32 px digits (16x16 latents), 1,024 = 64 px (32x32), 4,096 = 128 px (64x64); the judge scores samples
resized to 32 px. (Pixel space was tried first: at 1,200 steps its samples were not digits.) Every variant of
one (token count, seed) sees the same batches, noise and timesteps, and the same sampling seeds.

Attention variants (:data:`VARIANTS`): softmax; global linear attention (MHLA with one block: the same
feature map, so only the blocks differ); MHLA with the paper's formula; MHLA with LePE and the output gate
(the paper's full variant); the released DiT-MHLA setting (:meth:`MHLAConfig.released_dit`). Every
MHLA variant uses the same square layout with ``M <= sqrt(N)`` (:func:`mhla_layout`).

Each run records the training steps per second, judge accuracy, judge FID / precision / recall against
the held-out digits, seconds per sample, and per layer the effective rank of each head's attention output
(``exp`` of the entropy of its normalised singular values; at most the head dimension) over a fixed batch
of noised training latents: the quantity the paper's expressivity argument is about. Runs are resumable
inside (checkpoints every ``checkpoint_every`` steps) and skipped once finished; each run's ``seconds`` add up
all its attempts (:class:`~mhla_diffusion.embedded.stages.Stages`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch
import torch.nn.functional as F

from ..config import MHLAConfig
from ..utils.geometry import ImageGeometry
from .image_judge import images_to_tensor, tensor_to_uint8
from .digits import DIGIT_SIZE, NUM_DIGIT_CLASSES, load_digits_images, split_digits
from .judge_io import load_judge
from .locations import embedded_judge, embedded_model, weight_hashes
from .reproduction import score_digits
from .stages import Stages
from .training_loop import LoopLog, LoopProgress, epoch_batch, run_loop

__all__ = ["ExperimentSettings", "VARIANTS", "check_digits_vae", "effective_rank", "geometry_for", "mhla_layout",
           "run_experiment", "summarise"]

logger = logging.getLogger(__name__)

def mhla_layout(side: int) -> tuple[int, int]:
    """The MHLA layout of every MHLA variant on a ``side`` x ``side`` token grid: ``k`` x ``k`` blocks with
    the largest power of two ``k`` that divides ``side`` and keeps ``M = k * k <= sqrt(N)`` (the paper's
    rule): 4x4 blocks at 256 and 1,024 tokens, 8x8 at 4,096."""
    k = 1
    while side % (2 * k) == 0 and (2 * k) ** 2 <= side:
        k *= 2
    return (k, k)


#: Variant name -> MHLA options (``None``: softmax) for a ``side`` x ``side`` token grid.
VARIANTS: dict[str, Callable[[int], MHLAConfig | None]] = {
    "softmax": lambda side: None,
    "linear": lambda side: MHLAConfig(layout=(1, 1)),
    "mhla": lambda side: MHLAConfig(layout=mhla_layout(side)),
    "mhla-lepe-gate": lambda side: MHLAConfig(layout=mhla_layout(side), lepe=True, gate=True),
    "mhla-released-dit": lambda side: MHLAConfig.released_dit(layout=mhla_layout(side)),
}
EVAL_SEED, RANK_SEED = 10_000, 20_000
VAE_FACTOR, LATENT_CHANNELS = 2, 4  # the embedded digits VAE: 2x spatial compression, 4 channels
RANK_TIMESTEP = 500


@dataclass
class ExperimentSettings:
    """Every setting of one experiment (defaults: the committed table; :meth:`smoke`: CI)."""

    variants: list[str] = field(default_factory=lambda: list(VARIANTS))
    token_counts: list[int] = field(default_factory=lambda: [256, 1024])
    steps: list[int] = field(default_factory=lambda: [1200, 1200])  # per token count
    seeds: list[int] = field(default_factory=lambda: [0, 1])
    batch_size: int = 16
    layers: int = 4
    heads: int = 2
    head_dim: int = 32
    lr: float = 5e-4
    warmup_steps: int = 100
    eval_samples: int = 200
    sample_steps: int = 25
    guidance_scale: float = 4.0
    eval_batch_size: int = 50
    rank_batch: int = 8
    checkpoint_every: int = 100
    split_seed: int = 0

    @classmethod
    def smoke(cls) -> "ExperimentSettings":
        return cls(token_counts=[16, 64], steps=[2, 2], layers=1, heads=1, head_dim=8, eval_samples=10, sample_steps=2,
                   eval_batch_size=10, rank_batch=2, warmup_steps=1, checkpoint_every=1)

    def check(self) -> None:
        unknown = [v for v in self.variants if v not in VARIANTS]
        if unknown:
            raise ValueError(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
        if len(self.steps) != len(self.token_counts):
            raise ValueError(f"steps ({self.steps}) needs one entry per token count ({self.token_counts})")
        for tokens in self.token_counts:
            geometry_for(tokens)
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds must be distinct and at least one, got {self.seeds}")


def geometry_for(tokens: int) -> tuple[int, int]:
    """Token count -> (image size, latent side): a ``side`` x ``side`` latent grid with patch 1 is ``tokens``
    tokens, from ``2 * side`` px digits (the VAE compresses 2x)."""
    side = math.isqrt(tokens)
    if side * side != tokens or side < 4:
        raise ValueError(f"token count {tokens} is not a square of at least 4x4 (256, 1024, 4096, ...)")
    return VAE_FACTOR * side, side


# ---------------------------------------------------------------------------- one run


def _new_model(s: ExperimentSettings, variant: str, tokens: int, seed: int):
    from ..finetune.dit_scratch import new_dit_transformer

    _, side = geometry_for(tokens)
    config = dict(num_layers=s.layers, num_attention_heads=s.heads, attention_head_dim=s.head_dim,
                  in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS, sample_size=side, patch_size=1,
                  num_embeds_ada_norm=NUM_DIGIT_CLASSES,
                  norm_type="ada_norm_zero")
    # torch's default initialisation, not DiT's: at this budget DiT's zero-initialised adaLN gates and
    # 0.02-std embeddings leave the model unconditioned (latent digits, 1,200 steps: 10.5 % of samples
    # read as their class with DiT's init, 85 % with the default one)
    return new_dit_transformer(config, seed=seed, mhla=VARIANTS[variant](side), share=False, dit_init=False)


def _train(model, s: ExperimentSettings, images: torch.Tensor, labels: torch.Tensor, steps: int, seed: int,
           progress: LoopProgress) -> LoopLog:
    """DDPM epsilon-prediction (DiT's linear schedule, 1000 steps), AdamW with warm-up; class labels are
    dropped 10 % of the time by the model itself (classifier-free guidance). Every draw (batch, noise,
    timesteps, label drops, dropout) depends on ``(seed, step)`` only. Returns the losses and the training
    seconds of the steps that count, over every attempt."""
    from ..finetune.dit_scratch import dit_scheduler

    scheduler = dit_scheduler()
    optimizer = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: min(1.0, (k + 1) / max(1, s.warmup_steps)))

    def loss_fn(step: int) -> torch.Tensor:
        torch.manual_seed(int(np.random.SeedSequence([seed, step, 7]).generate_state(1)[0]))  # label drops, dropout
        pick = torch.from_numpy(epoch_batch(step, s.batch_size, len(images), seed))
        x0, y = images[pick], labels[pick]
        noise = torch.randn_like(x0)
        t = torch.randint(0, scheduler.config.num_train_timesteps, (len(x0),))
        prediction = model(scheduler.add_noise(x0, noise, t), timestep=t, class_labels=y).sample
        return F.mse_loss(prediction, noise)

    model.train()
    with torch.random.fork_rng(devices=[]):  # the per-step seeding stays inside the run
        log = run_loop(progress.checkpoint.parent.name if progress.checkpoint else "run", steps, loss_fn, model,
                       optimizer, schedule, progress, clip_norm=1.0)
    model.eval()
    return log


@torch.no_grad()
def _sample(model, vae, s: ExperimentSettings, labels: np.ndarray, side: int) -> tuple[np.ndarray, list[float]]:
    """DDIM (``sample_steps``) with classifier-free guidance on ``side`` x ``side`` latents, decoded by ``vae``;
    sample ``i`` from seed ``EVAL_SEED + i``. Returns uint8 images ``(n, 2 side, 2 side, 3)`` and the seconds
    per sample of each batch (decoding included)."""
    from ..finetune.dit_scratch import dit_scheduler
    from ..finetune.latents import dit_latent_normalization

    scheduler = dit_scheduler()
    shift, scale = dit_latent_normalization(vae)
    scheduler.set_timesteps(s.sample_steps)
    out, per_sample = [], []
    for start in range(0, len(labels), s.eval_batch_size):
        y = torch.as_tensor(labels[start: start + s.eval_batch_size], dtype=torch.int64)
        began = time.perf_counter()
        x = torch.stack([torch.randn(LATENT_CHANNELS, side, side, generator=torch.Generator().manual_seed(EVAL_SEED + start + i))
                         for i in range(len(y))])
        both = torch.cat([y, torch.full_like(y, NUM_DIGIT_CLASSES)])  # the null class drops the label
        for t in scheduler.timesteps:
            eps = model(torch.cat([x, x]), timestep=t.expand(2 * len(y)), class_labels=both).sample
            cond, uncond = eps.chunk(2)
            x = scheduler.step(uncond + s.guidance_scale * (cond - uncond), t, x).prev_sample
        images = vae.decode(x / scale + shift).sample
        per_sample.append((time.perf_counter() - began) / len(y))
        out.append(tensor_to_uint8(images))
    return np.concatenate(out), per_sample


def effective_rank(matrix: torch.Tensor) -> float:
    """``exp`` of the entropy of the normalised singular values of a 2-D ``matrix`` (Roy & Vetterli):
    1 for rank one, ``min(shape)`` for equal singular values."""
    values = torch.linalg.svdvals(matrix.double())
    total = values.sum()
    if total <= 0:
        return 0.0
    p = values / total
    p = p[p > 0]
    return float(torch.exp(-(p * p.log()).sum()))


@torch.no_grad()
def attention_ranks(model, images: torch.Tensor, labels: torch.Tensor, heads: int) -> list[float]:
    """Per layer: the mean over samples and heads of the effective rank of each head's attention output
    ``(N, head_dim)`` (the input of the output projection) on ``images`` noised at timestep
    :data:`RANK_TIMESTEP` with fixed noise."""
    from ..finetune.dit_scratch import dit_scheduler

    noise = torch.randn(images.shape, generator=torch.Generator().manual_seed(RANK_SEED))
    t = torch.full((len(images),), RANK_TIMESTEP)
    captured: list[torch.Tensor] = []
    hooks = [block.attn1.to_out[0].register_forward_pre_hook(lambda module, args: captured.append(args[0].detach()))
             for block in model.transformer_blocks]
    try:
        model(dit_scheduler().add_noise(images, noise, t), timestep=t, class_labels=labels)
    finally:
        for hook in hooks:
            hook.remove()
    ranks = []
    for out in captured:  # (B, N, heads * head_dim)
        per_head = out.reshape(out.shape[0], out.shape[1], heads, -1).permute(0, 2, 1, 3)
        ranks.append(float(np.mean([effective_rank(m) for m in per_head.flatten(0, 1)])))
    return ranks


def _run(folder: Path, s: ExperimentSettings, variant: str, tokens: int, steps: int, seed: int, data: dict[str, Any],
         judge, on_step: Callable[[str, int], None] | None) -> dict[str, Any]:
    """Train (resuming from ``folder/checkpoint.pt``), sample, score and measure one run."""
    name = folder.name
    size, side = geometry_for(tokens)
    latents, labels = data[size]
    model = _new_model(s, variant, tokens, seed)
    progress = LoopProgress(folder / "checkpoint.pt", every=s.checkpoint_every, show=True,
                            on_step=None if on_step is None else (lambda step: on_step(name, step)))
    log = _train(model, s, latents, labels, steps, seed, progress)
    eval_labels = np.arange(s.eval_samples) % NUM_DIGIT_CLASSES
    samples, times = _sample(model, data["vae"], s, eval_labels, side)
    accuracy, metrics = score_digits(_to_judge_size(samples), eval_labels, data["reference"], judge)
    rank_pick = torch.arange(s.rank_batch) * (len(latents) // max(1, s.rank_batch))
    ranks = attention_ranks(model, latents[rank_pick], labels[rank_pick], s.heads)
    result = {
        "variant": variant, "tokens": tokens, "seed": seed, "image_size": size, "latent": [LATENT_CHANNELS, side, side],
        "steps": steps,
        "parameters": int(sum(p.numel() for p in model.parameters())),
        "final_loss": float(np.mean(log.losses[-50:])), "train_seconds": round(log.seconds, 1),
        "steps_per_second": round(steps / max(log.seconds, 1e-9), 3),
        "accuracy": accuracy["digit"], "fid": metrics["fid"], "precision": metrics.get("precision"),
        "recall": metrics.get("recall"), "seconds_per_sample": statistics.median(times),
        "attention_rank_per_layer": ranks, "attention_rank": float(np.mean(ranks)),
        "mhla": None if variant == "softmax" else _mhla_of(model),
    }
    return result


def _to_judge_size(images: np.ndarray) -> np.ndarray:
    """uint8 images -> 32 px (the judge's size): average-pooled when larger, bilinear when smaller."""
    size = images.shape[1]
    if size == DIGIT_SIZE:
        return images
    x = images_to_tensor(images)
    x = F.avg_pool2d(x, size // DIGIT_SIZE) if size > DIGIT_SIZE else F.interpolate(x, size=DIGIT_SIZE, mode="bilinear")
    return tensor_to_uint8(x)


def check_digits_vae(config: Mapping[str, Any]) -> None:
    """Raise if a VAE config is not the one :data:`VAE_FACTOR` / :data:`LATENT_CHANNELS` describe (the experiment's
    image sizes and latent shapes follow from them)."""
    found = (ImageGeometry.from_configs(vae=config).vae_scale, int(config["latent_channels"]))
    if found != (VAE_FACTOR, LATENT_CHANNELS):
        raise ValueError(f"the digits VAE compresses {found[0]}x into {found[1]} channels, but the experiment is set "
                         f"up for {VAE_FACTOR}x and {LATENT_CHANNELS} channels (VAE_FACTOR, LATENT_CHANNELS in "
                         f"{__name__}); change those two constants to match the VAE")


def encode_digits(vae, images: np.ndarray, batch_size: int = 256) -> torch.Tensor:
    """uint8 digits ``(n, H, W, 3)`` -> VAE latents ``(n, 4, H / 2, W / 2)``: the posterior means, normalised as
    the DiT trainer does (:func:`~mhla_diffusion.finetune.latents.dit_latent_normalization`)."""
    from ..finetune.latents import dit_latent_normalization, encode_posterior

    shift, scale = dit_latent_normalization(vae)
    parts = [encode_posterior(vae, images_to_tensor(images[i:i + batch_size]), shift, scale)[:, :LATENT_CHANNELS]
             for i in range(0, len(images), batch_size)]
    return torch.cat(parts)


def _mhla_of(model) -> dict[str, Any]:
    from ..models.conversion import get_mhla_conversion

    conversion = get_mhla_conversion(model)
    return {"layout": list(conversion.layout), **{k: v for k, v in conversion.config.to_dict().items()
                                                  if k in ("normalization", "lepe", "gate", "input_norm")}}


# ---------------------------------------------------------------------------- the experiment


def run_experiment(out: str | Path, settings: ExperimentSettings | None = None,
                   on_step: Callable[[str, int], None] | None = None, figure: str | Path | None = None,
                   vae: str | Path | None = None, judge: str | Path | None = None) -> dict[str, Any]:
    """Train and score every (token count, seed, variant); resumes a killed experiment in ``out``.

    Writes ``out/report.json`` (every setting, run and time), ``out/table.md`` and ``out/fid-vs-tokens.png``
    (copied to ``figure`` when given). ``on_step(run, step)`` is called after every training step. ``vae`` (an
    ``AutoencoderKL`` folder) and ``judge`` (an image judge folder) default to the embedded digits VAE and judge.
    """
    s = settings or ExperimentSettings()
    s.check()
    out = Path(out)
    vae_folder = Path(vae) if vae is not None else embedded_model("class-to-image", "softmax") / "vae"
    judge_folder = Path(judge) if judge is not None else embedded_judge("image")
    for name, folder, config in (("vae", vae_folder, "config.json"), ("judge", judge_folder, "judge_config.json")):
        if not (folder / config).is_file():
            raise FileNotFoundError(f"{name} folder {folder} has no {config}: give the folder that holds it")
    check_digits_vae(json.loads((vae_folder / "config.json").read_text()))  # before anything is written to ``out``
    out.mkdir(parents=True, exist_ok=True)
    # the runs depend on the VAE and the judge too: a rebuild of the embedded models must not reuse old runs
    inputs = {"vae": weight_hashes(vae_folder), "judge": weight_hashes(judge_folder)}
    settings_file = out / "settings.json"
    wanted = {k: v for k, v in dataclasses.asdict(s).items() if k != "checkpoint_every"} | {"inputs_sha256": inputs}
    if settings_file.is_file() and json.loads(settings_file.read_text()) != wanted:
        raise ValueError(f"{out} holds an experiment with other settings or another VAE or judge ({settings_file}); "
                         "use another --output or delete that folder")
    settings_file.write_text(json.dumps(wanted, indent=2))
    from diffusers import AutoencoderKL

    judge = load_judge(judge_folder)
    vae = AutoencoderKL.from_pretrained(vae_folder).eval()
    split = split_digits(seed=s.split_seed)
    data: dict[Any, Any] = {"reference": split.test_images, "vae": vae}
    for tokens in s.token_counts:
        size, _ = geometry_for(tokens)
        if size not in data:
            images = split.train_images if size == DIGIT_SIZE else load_digits_images(size)[0][split.train_indices]
            data[size] = (encode_digits(vae, images), torch.from_numpy(split.train_labels))
    runs = []
    stages = Stages(out, total=len(s.token_counts) * len(s.seeds) * len(s.variants), watched=("runs",), noun="run")
    for tokens, steps in zip(s.token_counts, s.steps):
        for seed in s.seeds:
            for variant in s.variants:
                folder = out / "runs" / f"{variant}-{tokens}tok-seed{seed}"
                runs.append(stages.run(folder.name, lambda: _run(folder, s, variant, tokens, steps, seed, data, judge,
                                                                 on_step)))
                shutil.rmtree(folder, ignore_errors=True)  # its checkpoint; the result is in stages/
    report = {"settings": dataclasses.asdict(s), "inputs_sha256": inputs, "torch_threads": torch.get_num_threads(),
              "runs": runs, "summary": summarise(runs), "seconds": round(sum(r["seconds"] for r in runs), 1)}
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "table.md").write_text(table_markdown(report["summary"], s))
    plot_fid(report["summary"], out / "fid-vs-tokens.png")
    if figure is not None:
        Path(figure).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(out / "fid-vs-tokens.png", figure)
    return report


_MEASURES = ("fid", "accuracy", "precision", "recall", "attention_rank", "steps_per_second",
             "seconds_per_sample")


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (token count, variant): mean, min and max over seeds of every measure, and for each variant
    other than softmax whether its FID range over seeds lies apart from softmax's."""
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault((run["tokens"], run["variant"]), []).append(run)
    rows = []
    for (tokens, variant), members in groups.items():
        row: dict[str, Any] = {"tokens": tokens, "variant": variant, "seeds": [m["seed"] for m in members]}
        for measure in _MEASURES:
            values = [m[measure] for m in members if m[measure] is not None]
            row[measure] = ({"mean": float(np.mean(values)), "min": float(min(values)), "max": float(max(values))}
                            if values else None)
        rows.append(row)
    for row in rows:
        reference = next((r for r in rows if r["tokens"] == row["tokens"] and r["variant"] == "softmax"), None)
        if reference is None or row["variant"] == "softmax":
            row["fid_vs_softmax"] = None
            continue
        a, b = row["fid"], reference["fid"]
        row["fid_vs_softmax"] = {"difference_of_means": a["mean"] - b["mean"],
                                 "apart": bool(a["min"] > b["max"] or a["max"] < b["min"]),
                                 "worse": bool(a["min"] > b["max"]), "better": bool(a["max"] < b["min"])}
    return rows


def _cell(stat: dict[str, float] | None, scale: float = 1.0, digits: int = 1) -> str:
    if stat is None:
        return ""
    return f"{stat['mean'] * scale:.{digits}f} [{stat['min'] * scale:.{digits}f}-{stat['max'] * scale:.{digits}f}]"


def table_markdown(summary: list[dict[str, Any]], s: ExperimentSettings) -> str:
    """The summary as a Markdown table: mean [min-max] over seeds."""
    header = ["tokens", "attention", "FID (judge)", "FID vs softmax", "acc digit %", "precision %", "recall %",
              "attention rank (of " + str(s.head_dim) + ")", "train steps / s", "ms / sample"]
    lines = [f"{len(s.seeds)} seeds per row (mean [min-max]); {s.eval_samples} samples per run, "
             f"{s.sample_steps} DDIM steps, guidance {s.guidance_scale}", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in summary:
        versus = row["fid_vs_softmax"]
        verdict = "" if versus is None else (f"{versus['difference_of_means']:+.1f}"
                                             + (" (worse beyond seed spread)" if versus["worse"] else
                                                " (better beyond seed spread)" if versus["better"] else
                                                " (within seed spread)"))
        cells = [str(row["tokens"]), row["variant"], _cell(row["fid"]), verdict, _cell(row["accuracy"], 100),
                 _cell(row["precision"], 100), _cell(row["recall"], 100), _cell(row["attention_rank"]),
                 _cell(row["steps_per_second"], digits=2), _cell(row["seconds_per_sample"], 1000, 0)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_fid(summary: list[dict[str, Any]], path: Path) -> None:
    """Judge FID against token count, one line per variant, the seeds' min-max as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    for variant in dict.fromkeys(r["variant"] for r in summary):
        rows = sorted((r for r in summary if r["variant"] == variant), key=lambda r: r["tokens"])
        x = [r["tokens"] for r in rows]
        mean = np.array([r["fid"]["mean"] for r in rows])
        low = mean - np.array([r["fid"]["min"] for r in rows])
        high = np.array([r["fid"]["max"] for r in rows]) - mean
        ax.errorbar(x, mean, yerr=[low, high], marker="o", capsize=3, label=variant)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per sample")
    ax.set_ylabel("FID on the judge's features (lower is better)")
    ax.set_title("Digits, DiT trained from scratch: seeds' mean, bars min-max")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
