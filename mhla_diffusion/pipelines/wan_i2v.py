"""Image-to-video: Diffusers' ``WanImageToVideoPipeline`` with MHLA self-attention.

For Wan2.1-I2V (CLIP image encoder; image keys / values in every cross-attention), Wan2.2-I2V-A14B (two
transformers, image latents concatenated on the channels) and Wan2.2-TI2V-5B (``expand_timesteps``: the
image is the clean first latent frame). MHLA replaces self-attention (``attn1``) only: the cross-attention
(``attn2``) with its image projections (``add_k_proj``, ``add_v_proj``, ``norm_added_k``) keeps Diffusers'
processor. The token grid comes from the latent video that enters the transformer (36 channels: noisy
latent, mask and image latent; 48 for TI2V-5B), exactly as for text-to-video.
"""

from __future__ import annotations

import functools
from typing import Any, Iterable, Mapping

from diffusers import WanImageToVideoPipeline, WanPipeline

from .wan_video import MHLAWanVideoMixin

__all__ = ["IMAGE_TEXT_TOKENS", "MHLAWanImageToVideoPipeline", "check_text_tokens"]

#: Text tokens Diffusers' ``WanAttnProcessor`` expects after the image tokens in the cross-attention of a
#: Wan2.1-I2V transformer (a constant in Diffusers 0.42: the context is split at ``len - 512``).
IMAGE_TEXT_TOKENS = 512


def check_text_tokens(
    transformer_configs: Iterable[Mapping[str, Any]], length: int, what: str = "max_sequence_length is"
) -> None:
    """Raise ``ValueError`` when a transformer with image keys / values in its cross-attention (Wan2.1-I2V:
    ``added_kv_proj_dim`` in its config) would get a text of ``length`` tokens other than :data:`IMAGE_TEXT_TOKENS`
    (``what`` names the length in the message)."""
    if length != IMAGE_TEXT_TOKENS and any(c.get("added_kv_proj_dim") is not None for c in transformer_configs):
        raise ValueError(
            f"{what} {length} text tokens, but this image-to-video model (image keys / values in its cross-attention) "
            f"needs {IMAGE_TEXT_TOKENS}: Diffusers' Wan attention reads the last {IMAGE_TEXT_TOKENS} context tokens "
            f"as text and the ones before as the image; use max_sequence_length={IMAGE_TEXT_TOKENS} (the default)"
        )


class MHLAWanImageToVideoPipeline(MHLAWanVideoMixin, WanImageToVideoPipeline):
    """``WanImageToVideoPipeline`` whose transformers may use MHLA (see :class:`MHLAPipelineMixin` and
    :class:`MHLAWanVideoMixin`): ``pipe(image=..., prompt=...)`` as in Diffusers, with the same size checks
    before work as :class:`MHLAWanPipeline`. ``from_pretrained`` also loads a Wan2.2-TI2V-5B folder (saved as a
    ``WanPipeline``) for image-to-video, as Diffusers' own class does.

    Prompts are encoded with ``WanPipeline``'s code: Diffusers 0.42's ``WanImageToVideoPipeline`` calls
    ``ftfy.fix_text`` without checking that the optional ``ftfy`` package is installed (``NameError: name
    'ftfy' is not defined``), where ``WanPipeline`` checks first; the two are otherwise the same code, and
    identical when ``ftfy`` is installed.
    """

    _stock_pipeline_name = "WanImageToVideoPipeline"

    _get_t5_prompt_embeds = WanPipeline._get_t5_prompt_embeds

    def check_call(self, arguments: dict[str, Any]) -> None:
        """:meth:`MHLAWanVideoMixin.check_call`, and for Wan2.1-I2V (image keys / values in the cross-attention,
        ``added_kv_proj_dim``) a text of exactly :data:`IMAGE_TEXT_TOKENS` tokens: Diffusers' ``WanAttnProcessor``
        takes the last 512 context tokens as text and the ones before as the image, so another
        ``max_sequence_length`` (or ``prompt_embeds`` of another length) would silently mix them up."""
        super().check_call(arguments)
        embeds = arguments.get("prompt_embeds")
        check_text_tokens(
            [t.config for t in self.transformer_components.values()],
            embeds.shape[1] if embeds is not None else arguments["max_sequence_length"],
            "prompt_embeds have" if embeds is not None else "max_sequence_length is",
        )

    @functools.wraps(
        WanImageToVideoPipeline.__call__
    )  # Diffusers' signature and docs (inspect.signature follows __wrapped__)
    def __call__(self, *args: Any, **kwargs: Any):
        return self.checked_call(args, kwargs)
