"""Everything that builds the embedded models: ``mhla build-embedded``'s stages (:mod:`.build`; its resumable
units and training loop are :mod:`mhla_diffusion.training`'s), the tiny VAEs
(:mod:`.autoencoders`), the streaming student (:mod:`.stream_build`), the long-video measures and report
(:mod:`.long_video`, :mod:`.long_video_diagnosis`, :mod:`.long_video_report`), the side-by-side figure
(:mod:`.side_by_side`) and the reproduction table (:mod:`.reproduction`)."""
