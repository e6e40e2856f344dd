"""ADM-compatible FID / sFID / IS / precision-recall evaluation (installed as
``mhla_diffusion.eval``). Built by the evaluation issue."""
