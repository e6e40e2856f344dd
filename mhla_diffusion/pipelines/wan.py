"""Text-to-video: Diffusers' ``WanPipeline`` with MHLA self-attention."""

from __future__ import annotations

import inspect
from typing import Any

from diffusers import WanPipeline

from ..geometry import VideoGeometry, check_layout_fits
from .mhla_mixin import MHLAPipelineMixin

__all__ = ["MHLAWanPipeline"]


class MHLAWanPipeline(MHLAPipelineMixin, WanPipeline):
    """``WanPipeline`` whose transformer may use MHLA (see :class:`MHLAPipelineMixin`).

    Sampling is Diffusers' own: schedulers swap as usual, and ``generator``, ``output_type``,
    ``callback_on_step_end``, CFG, negative prompts and ``prompt_embeds`` behave as in ``WanPipeline``.
    Before any work, a size the model cannot generate (e.g. larger than its position encoding holds) is
    refused with a readable ``ValueError``. A token grid smaller than the MHLA block layout on some axis
    (an image-sized 1-frame call under a video layout) is fine: its extra blocks are empty.
    """

    _stock_pipeline_name = "WanPipeline"
    _stock_transformer_name = "WanTransformer3DModel"
    _mhla_transformer_name = "MHLAWanTransformer3DModel"

    @property
    def geometry(self) -> VideoGeometry:
        """This pipeline's size rules, read from its transformer and VAE configs."""
        return VideoGeometry.from_pipeline(self)

    def token_grid(self, num_frames: int, height: int, width: int) -> tuple[int, int, int]:
        """Token grid (frames, height, width) this pipeline's transformer sees for a video size
        (frames rounded down to ``k * temporal + 1`` as ``WanPipeline`` does)."""
        return self.geometry.token_grid(num_frames, height, width, strict=False)

    def check_mhla_size(self, num_frames: int, height: int, width: int) -> None:
        """Raise ``ValueError`` when the MHLA block layout cannot run on the video's token grid: only with
        normalization ``scalar_mixed_denominator``, which needs a layout that divides the grid (a grid
        smaller than the layout is otherwise fine: the extra blocks are empty)."""
        conversion = self.mhla
        if conversion is None:
            return
        check_layout_fits(self.token_grid(num_frames, height, width), conversion.layout,
                          f"a {num_frames}x{height}x{width} video", conversion.config.normalization)

    def load_lora_weights(self, pretrained_model_name_or_path_or_dict, adapter_name: str | None = None, **kwargs: Any):
        """Diffusers' ``load_lora_weights``, refusing a LoRA file trained on MHLA layers (the mark our trainer
        writes in its metadata, see :mod:`mhla_diffusion.pipelines.lora`) when this transformer lacks them."""
        from .lora import check_lora_mark, lora_file

        path = lora_file(pretrained_model_name_or_path_or_dict, kwargs.get("weight_name"), kwargs.get("subfolder"))
        if path is not None and path.suffix == ".safetensors":
            check_lora_mark(path, self.mhla)
        return super().load_lora_weights(pretrained_model_name_or_path_or_dict, adapter_name=adapter_name, **kwargs)

    def check_size(self, num_frames: int, height: int, width: int) -> None:
        """Raise ``ValueError`` naming the model's limits when this pipeline cannot generate the size: frames
        (as ``WanPipeline`` rounds them), multiples, and the largest size its position encoding holds
        (``VideoGeometry.check_size(..., generation=True)``), before any work."""
        geometry = self.geometry
        geometry.check_size(geometry.round_frames(num_frames), height, width, generation=True)

    def unknown_words(self, prompt: str) -> list[str]:
        """The words (or parts of words, e.g. an emoji or a comma) of ``prompt`` the tokenizer does not know:
        each becomes its unknown token, so the model never sees it. Empty when the tokenizer has no unknown token."""
        tokenizer = getattr(self, "tokenizer", None)
        unk = getattr(tokenizer, "unk_token_id", None)
        if tokenizer is None or unk is None:
            return []
        try:
            encoded = tokenizer(prompt, add_special_tokens=False, return_offsets_mapping=True)
            hits = [prompt[start:end] for token, (start, end) in zip(encoded["input_ids"], encoded["offset_mapping"])
                    if token == unk and end > start]
        except (NotImplementedError, ValueError, TypeError, KeyError):  # a slow tokenizer: word by word
            hits = [word for word in prompt.split() if unk in tokenizer(word, add_special_tokens=False)["input_ids"]]
        return list(dict.fromkeys(hits))

    def __call__(self, *args: Any, **kwargs: Any):
        bound = inspect.signature(WanPipeline.__call__).bind(self, *args, **kwargs)
        bound.apply_defaults()
        size = bound.arguments["num_frames"], bound.arguments["height"], bound.arguments["width"]
        self.check_size(*size)
        self.check_mhla_size(*size)
        return super().__call__(*args, **kwargs)

    __call__.__doc__ = WanPipeline.__call__.__doc__
