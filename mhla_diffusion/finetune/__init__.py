"""Fine-tuning Wan2.1 and DiT converted to MHLA, with Accelerate (installed as ``mhla_diffusion.finetune``);
``attention: softmax`` trains the softmax models as they are (e.g. teachers for an MHLA run).

Trainers (one script each, ``python -m`` or ``accelerate launch -m``):

* ``mhla_diffusion.finetune.train_wan``: text-to-video, flow matching (Wan2.1 + MHLA).
* ``mhla_diffusion.finetune.train_dit``: class-to-image, epsilon + VB with EMA (DiT + MHLA).

Modules: ``options`` (YAML + CLI options), ``media`` / ``buckets`` / ``data`` / ``video_data`` /
``image_data`` (data), ``latents`` / ``text`` / ``latent_cache`` (encoders and the cache pre-pass),
``objectives`` (losses), ``trainable`` (what trains, LoRA), ``attention_transfer`` (stage 1),
``checkpointing`` (run folders, atomic checkpoints), ``tracking`` / ``validation`` (logs, samples),
``engine`` (the shared loop). See ``finetune/README.md``.
"""
