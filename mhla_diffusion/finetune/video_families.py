"""What the text-to-video trainer needs to know per model family, beside the transformer: the pipeline class, the
VAE's latent normalisation and size rules, how prompts become the transformer's text inputs, and how validation
feeds them to the pipeline.

* **Wan** (2.1, 2.2) and **SkyReels-V2**: one UMT5 encoder, its unpadded ``(L, D)`` prompt embeddings zero-padded
  to ``max_sequence_length`` (as ``WanPipeline`` / ``SkyReelsV2Pipeline`` do), the Wan VAE's per-channel latent
  statistics.
* **HunyuanVideo** (joint image-text attention): a Llama encoder (the prompt template and its ``crop_start``, as
  ``HunyuanVideoPipeline.encode_prompt``), right-padded with a text mask, plus CLIP's pooled embedding; the VAE's
  ``scaling_factor``; the embedded guidance ``guidance_scale x 1000`` its pipeline gives the transformer.

Every family trains with the same flow-matching objective (:mod:`mhla_diffusion.finetune.objectives`): each of
these models was trained so. A family is chosen by the transformer class the pipeline's ``model_index.json``
names (:func:`video_recipe_for`).
"""

from __future__ import annotations

import importlib
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from ..models.families import FAMILIES, ModelFamily, family_for_class_name
from ..utils.geometry import VideoGeometry
from .latents import wan_latent_normalization
from .text import encode_prompts, pad_prompt_embeds

__all__ = [
    "HunyuanVideoRecipe",
    "SkyReelsV2Recipe",
    "TRAINABLE_VIDEO_FAMILIES",
    "VideoRecipe",
    "WanRecipe",
    "video_recipe_for",
]


class VideoRecipe:
    """One family's side of the text-to-video trainer (see the module docstring)."""

    family: ModelFamily
    #: The pipeline's components the trainer loads besides the transformer and the VAE.
    text_components: tuple[str, ...] = ("tokenizer", "text_encoder")
    #: ``"diffusers:<class>"``: the stock pipeline that validation samples with and ``save_pipeline`` writes.
    pipeline_path: str = ""
    #: The guidance scale of validation samples when neither the options nor the model give one.
    default_guidance_scale: float = 5.0
    #: Whether training a block-causal model is possible (per-token timesteps in the transformer's forward).
    causal: bool = False

    def __init__(self, family: ModelFamily) -> None:
        self.family = family

    @property
    def label(self) -> str:
        return self.family.label

    def pipeline_class(self) -> type:
        module, _, name = self.pipeline_path.partition(":")
        return getattr(importlib.import_module(module), name)

    # -- latents ------------------------------------------------------------------------------------------------

    def geometry(self, transformer: Mapping[str, Any], vae: Mapping[str, Any]) -> VideoGeometry:
        """Size rules from the transformer and VAE configs."""
        return VideoGeometry.from_configs(transformer, vae)

    def latent_channels(self, vae: Mapping[str, Any]) -> int:
        return int(vae["z_dim"])

    def latent_normalization(self, vae: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """``(shift, scale)`` of ``z_model = (z - shift) * scale``, broadcastable to ``(B, C, F, H, W)``."""
        return wan_latent_normalization(vae, self.latent_channels(vae.config))

    # -- text ---------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def encode(self, encoders: Mapping[str, Any], prompts: Sequence[str], max_length: int) -> list[dict[str, Any]]:
        """Per prompt, its unpadded text tensors (what the latent cache stores): Wan ``{"prompt_embeds": (L, D)}``."""
        embeds = encode_prompts(encoders["tokenizer"], encoders["text_encoder"], prompts, max_length)
        return [{"prompt_embeds": e} for e in embeds]

    def transformer_text(self, encoded: Sequence[Mapping[str, torch.Tensor]], max_length: int) -> dict[str, Any]:
        """The transformer's text keyword arguments for a batch of :meth:`encode` outputs (on their device)."""
        return {"encoder_hidden_states": pad_prompt_embeds([e["prompt_embeds"] for e in encoded], max_length).float()}

    def pipeline_text(
        self, encoded: Mapping[str, torch.Tensor], negative: Mapping[str, torch.Tensor] | None, max_length: int
    ) -> dict[str, Any]:
        """The pipeline call's precomputed text arguments for one prompt (and the negative prompt)."""
        text = {"prompt_embeds": pad_prompt_embeds([encoded["prompt_embeds"]], max_length)}
        if negative is not None:
            text["negative_prompt_embeds"] = pad_prompt_embeds([negative["prompt_embeds"]], max_length)
        return text

    def forward_extras(self, batch: int, guidance_scale: float, device: torch.device) -> dict[str, Any]:
        """Further transformer arguments of a training forward (HunyuanVideo: the embedded guidance)."""
        return {}


class WanRecipe(VideoRecipe):
    """Wan 2.1 / 2.2: ``MHLAWanPipeline`` (our pipeline: it saves MHLA whole and records generation defaults)."""

    pipeline_path = "mhla_diffusion.pipelines.wan:MHLAWanPipeline"
    causal = True


class SkyReelsV2Recipe(VideoRecipe):
    """SkyReels-V2 text-to-video: Wan's VAE, UMT5 encoder and forward; the stock ``SkyReelsV2Pipeline``."""

    pipeline_path = "diffusers:SkyReelsV2Pipeline"
    default_guidance_scale = 6.0


class HunyuanVideoRecipe(VideoRecipe):
    """HunyuanVideo: joint attention over [image, text], two text encoders, embedded guidance."""

    text_components = ("tokenizer", "text_encoder", "tokenizer_2", "text_encoder_2")
    pipeline_path = "diffusers:HunyuanVideoPipeline"
    default_guidance_scale = 6.0
    #: The text-only pipeline :meth:`encode` calls ``encode_prompt`` on (built on first use).
    _text_pipeline: Any = None

    def geometry(self, transformer: Mapping[str, Any], vae: Mapping[str, Any]) -> VideoGeometry:
        patch = int(transformer.get("patch_size") or 2)
        return VideoGeometry(
            vae_scale_temporal=int(vae.get("temporal_compression_ratio") or 4),
            vae_scale_spatial=int(vae.get("spatial_compression_ratio") or 8),
            patch_size=(int(transformer.get("patch_size_t") or 1), patch, patch),
            max_tokens_per_axis=None,
        )

    def latent_channels(self, vae: Mapping[str, Any]) -> int:
        return int(vae["latent_channels"])

    def latent_normalization(self, vae: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor(0.0), torch.tensor(float(vae.config.scaling_factor))

    @torch.no_grad()
    def encode(self, encoders: Mapping[str, Any], prompts: Sequence[str], max_length: int) -> list[dict[str, Any]]:
        """``{"prompt_embeds": (L, D), "pooled_prompt_embeds": (D2,)}`` per prompt, exactly as
        ``HunyuanVideoPipeline.encode_prompt`` makes them (the padding dropped: ``L`` is the prompt's own tokens)."""
        pipe = self._text_pipeline
        if pipe is None or pipe.text_encoder is not encoders["text_encoder"]:  # built once per set of encoders
            pipe = self.pipeline_class()(
                **{name: encoders[name] for name in self.text_components}, transformer=None, vae=None, scheduler=None
            )
            self._text_pipeline = pipe
        device = next(encoders["text_encoder"].parameters()).device
        embeds, pooled, mask = pipe.encode_prompt(prompts, device=device, max_sequence_length=max_length)
        lengths = mask.gt(0).sum(dim=1).tolist()
        return [{"prompt_embeds": e[:n], "pooled_prompt_embeds": p} for e, p, n in zip(embeds, pooled, lengths)]

    def _padded(self, encoded: Sequence[Mapping[str, torch.Tensor]], max_length: int) -> dict[str, torch.Tensor]:
        embeds = pad_prompt_embeds([e["prompt_embeds"] for e in encoded], max_length).float()
        mask = torch.zeros(embeds.shape[:2], device=embeds.device)
        for row, e in enumerate(encoded):
            mask[row, : e["prompt_embeds"].shape[0]] = 1
        pooled = torch.stack([e["pooled_prompt_embeds"] for e in encoded]).float()
        return {"prompt_embeds": embeds, "prompt_attention_mask": mask, "pooled_prompt_embeds": pooled}

    def transformer_text(self, encoded: Sequence[Mapping[str, torch.Tensor]], max_length: int) -> dict[str, Any]:
        padded = self._padded(encoded, max_length)
        return {
            "encoder_hidden_states": padded["prompt_embeds"],
            "encoder_attention_mask": padded["prompt_attention_mask"],
            "pooled_projections": padded["pooled_prompt_embeds"],
        }

    def pipeline_text(
        self, encoded: Mapping[str, torch.Tensor], negative: Mapping[str, torch.Tensor] | None, max_length: int
    ) -> dict[str, Any]:
        # the guidance is embedded (one pass per step); a negative prompt would only take part with true_cfg_scale
        return self._padded([encoded], max_length)

    def forward_extras(self, batch: int, guidance_scale: float, device: torch.device) -> dict[str, Any]:
        return {"guidance": torch.full((batch,), guidance_scale * 1000.0, device=device)}


_RECIPES: dict[str, type[VideoRecipe]] = {
    "wan": WanRecipe,
    "skyreels-v2": SkyReelsV2Recipe,
    "hunyuan-video": HunyuanVideoRecipe,
}
#: The families the text-to-video trainer trains (their transformer class names are what it accepts).
TRAINABLE_VIDEO_FAMILIES = tuple(_RECIPES)


def video_recipe_for(transformer_class_name: str | None, source: str) -> VideoRecipe:
    """The recipe of the family whose transformer class a pipeline's ``model_index.json`` names; ``ValueError``
    naming the families the trainer takes otherwise."""
    family = family_for_class_name(transformer_class_name) if transformer_class_name else None
    if family is None or family.name not in _RECIPES:
        names = ", ".join(FAMILIES[name].transformer_class_name for name in TRAINABLE_VIDEO_FAMILIES)
        raise ValueError(
            f"pretrained_model {source} has a {transformer_class_name!r} transformer; the text-to-video trainer "
            f"trains pipelines of {names}"
        )
    return _RECIPES[family.name](family)
