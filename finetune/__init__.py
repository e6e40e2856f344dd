"""Fine-tuning scripts that convert Wan2.1 / DiT to MHLA and train them with accelerate
(installed as ``mhla_diffusion.finetune``). Built by the fine-tuning issue."""
