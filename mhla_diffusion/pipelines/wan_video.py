"""What the MHLA Wan video pipelines share (text-to-video, image-to-video; Wan2.1 and Wan2.2).

:class:`MHLAWanVideoMixin` sits between :class:`~mhla_diffusion.pipelines.mhla_mixin.MHLAPipelineMixin`
and a Diffusers Wan pipeline (``WanPipeline``, ``WanImageToVideoPipeline``) and adds, from the loaded
model's own configs: the size rules (:mod:`mhla_diffusion.utils.geometry`: VAE factors, patch, RoPE table;
Wan2.2-TI2V-5B's VAE compresses x16 in space, the others x8), the checks every call runs before any
work, the words a prompt loses to the tokenizer, and the MHLA mark of LoRA files.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

from ..models.text_cache import TextConditioningCache
from ..utils.geometry import VideoGeometry, check_layout_fits
from .mhla_mixin import MHLAPipelineMixin

__all__ = ["MHLAWanVideoMixin"]


class MHLAWanVideoMixin(MHLAPipelineMixin):
    """Size checks, prompt words and LoRA checks of MHLA Wan video pipelines (see the module docstring).

    Mixed in before the Diffusers pipeline class: ``class P(MHLAWanVideoMixin, WanPipeline)``; the pipeline's
    ``__call__`` runs :meth:`checked_call`, which runs :meth:`check_call` first.
    """

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

    def check_size(self, num_frames: int, height: int, width: int) -> None:
        """Raise ``ValueError`` naming the model's limits when this pipeline cannot generate the size: frames
        (as ``WanPipeline`` rounds them), multiples, and the largest size its position encoding holds
        (``VideoGeometry.check_size(..., generation=True)``), before any work."""
        geometry = self.geometry
        geometry.check_size(geometry.round_frames(num_frames), height, width, generation=True)

    def check_mhla_size(self, num_frames: int, height: int, width: int) -> None:
        """Raise ``ValueError`` when the MHLA block layout of a transformer cannot run on the video's token grid:
        only with normalization ``scalar_mixed_denominator``, which needs a layout that divides the grid (a grid
        smaller than the layout is otherwise fine: the extra blocks are empty)."""
        for name, conversion in self.mhla_conversions.items():
            if conversion is not None:
                check_layout_fits(
                    self.token_grid(num_frames, height, width),
                    conversion.layout,
                    f"a {num_frames}x{height}x{width} video ({name})",
                    conversion.config.normalization,
                )

    def unknown_words(self, prompt: str) -> list[str]:
        """The words (or parts of words, e.g. an emoji or a comma) of ``prompt`` the tokenizer does not know:
        each becomes its unknown token, so the model never sees it. Empty when the tokenizer has no unknown token."""
        tokenizer = getattr(self, "tokenizer", None)
        unk = getattr(tokenizer, "unk_token_id", None)
        if tokenizer is None or unk is None:
            return []
        try:
            encoded = tokenizer(prompt, add_special_tokens=False, return_offsets_mapping=True)
            hits = [
                prompt[start:end]
                for token, (start, end) in zip(encoded["input_ids"], encoded["offset_mapping"])
                if token == unk and end > start
            ]
        except (NotImplementedError, ValueError, TypeError, KeyError):  # a slow tokenizer: word by word
            hits = [word for word in prompt.split() if unk in tokenizer(word, add_special_tokens=False)["input_ids"]]
        return list(dict.fromkeys(hits))

    def load_lora_weights(self, pretrained_model_name_or_path_or_dict, adapter_name: str | None = None, **kwargs: Any):
        """Diffusers' ``load_lora_weights``, refusing a LoRA file trained on MHLA layers (the mark our trainer
        writes in its metadata, see :mod:`mhla_diffusion.pipelines.lora`) when the transformer it goes into
        (``transformer``, or ``transformer_2`` with ``load_into_transformer_2=True``) lacks them."""
        from .lora import check_lora_mark, lora_file

        target = "transformer_2" if kwargs.get("load_into_transformer_2") else "transformer"
        source = pretrained_model_name_or_path_or_dict
        path = lora_file(source, kwargs.get("weight_name"), kwargs.get("subfolder"))
        if path is not None and path.suffix == ".safetensors":
            check_lora_mark(path, self.mhla_conversions.get(target))
        else:  # a state dict, a hub id or a pickled file: no metadata to read the mark from
            what = "a state dict" if isinstance(source, dict) else str(path or source)
            warnings.warn(
                f"load_lora_weights got {what}, which carries no MHLA mark: it is loaded without checking that "
                f"it was trained on this pipeline's {target} attention (MHLA or softmax); pass the local "
                ".safetensors file (or folder) the trainer wrote to have it checked",
                stacklevel=2,
            )
        return super().load_lora_weights(pretrained_model_name_or_path_or_dict, adapter_name=adapter_name, **kwargs)

    def check_call(self, arguments: dict[str, Any]) -> None:
        """Raise ``ValueError`` for a call the model cannot run, before any work: :meth:`check_size` and
        :meth:`check_mhla_size` on its ``num_frames``, ``height``, ``width``. ``arguments``: every argument of the
        Diffusers pipeline's ``__call__`` by name, defaults included."""
        size = arguments["num_frames"], arguments["height"], arguments["width"]
        self.check_size(*size)
        self.check_mhla_size(*size)

    def checked_call(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        """The Diffusers pipeline's ``__call__(*args, **kwargs)`` after :meth:`check_call`."""
        stock_call = super().__call__  # the Diffusers pipeline's, next in the method resolution order
        bound = inspect.signature(stock_call).bind(*args, **kwargs)
        bound.apply_defaults()
        self.check_call(bound.arguments)
        with TextConditioningCache(self.transformer, getattr(self, "transformer_2", None)):  # once per prompt
            return stock_call(*args, **kwargs)
