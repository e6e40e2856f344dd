"""Sampling pipelines over Diffusers' ``WanPipeline`` and ``DiTPipeline`` (installed as
``mhla_diffusion.pipelines``). Built by the pipelines issue; this package is empty until then."""
