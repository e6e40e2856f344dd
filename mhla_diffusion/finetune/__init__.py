"""Fine-tuning Wan2.1 and DiT converted to MHLA, with Accelerate;
``attention: softmax`` trains the softmax models as they are (e.g. teachers for an MHLA run).

Trainers (``python finetune/train_wan.py``, ``accelerate launch finetune/train_wan.py``, or ``-m`` with the module):

* ``mhla_diffusion.finetune.train_wan``: text-to-video, flow matching (Wan2.1 + MHLA).
* ``mhla_diffusion.finetune.train_dit``: class-to-image, epsilon + VB with EMA (DiT + MHLA), from a
  pretrained pipeline or from random initialisation (``model_size``).

Modules: ``options`` (YAML + CLI options), ``media`` / ``buckets`` / ``data`` / ``video_data`` /
``image_data`` (data), ``latents`` / ``text`` / ``latent_cache`` (encoders and the cache pre-pass),
``objectives`` (losses), ``dit_scratch`` (a DiT from random initialisation; sizes in
:mod:`mhla_diffusion.utils.dit_sizes`), ``trainable`` (what trains, LoRA), ``attention_transfer`` (stage 1),
``checkpointing`` (run folders, atomic checkpoints), ``tracking`` / ``validation`` (logs, samples),
``engine`` (the shared loop). The runnable scripts and example configs are in the repository's
``finetune/`` folder (``finetune/README.md``).
"""
