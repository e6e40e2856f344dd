"""Plain helpers for the tests: functions, classes and constants that tests call with arguments.

Imported as ``from helpers.<topic> import name`` (``tests/`` is on ``sys.path`` through pytest's
``pythonpath`` option in ``pyproject.toml``). Fixtures are not here: they live in ``conftest.py`` files
(see ``tests/conftest.py``). Modules by topic:

* :mod:`helpers.models` -- inputs for the tiny Wan / DiT transformers, running them, tiny-pipeline call arguments
* :mod:`helpers.attention` -- random inputs for the attention operators
* :mod:`helpers.cli` -- `mhla` command lines on the tiny pipelines (generation) and a toy-size `mhla bench`
* :mod:`helpers.original_format` -- tiny released-format (original Wan) checkpoints
* :mod:`helpers.media` -- writers of videos, images and image folders; synthetic image arrays
* :mod:`helpers.finetune` -- tiny trainer options, metrics, fixed-draw evaluators, tiny pretrained pipelines
* :mod:`helpers.features` -- a stand-in for the Inception feature network
* :mod:`helpers.shapes` -- measurements of the moving-shapes demo clips
* :mod:`helpers.wan_family` -- the Wan variants beyond Wan2.1 text-to-video: names, classes, call arguments
* :mod:`helpers.original_dit` -- tiny original-format DiT / DiT-MHLA checkpoints and our own forward of both
* :mod:`helpers.streaming` -- tiny block-causal pipelines, their streaming call and the chunk-by-chunk reference
* :mod:`helpers.long_video` -- a stand-in for the embedded long-video model, laid out as the build exports it
* :mod:`helpers.reproduce` -- checks that an ``mhla reproduce`` folder is what its ``report.json`` says
* :mod:`helpers.triton_compile` -- ahead-of-time ptxas compiles of recorded Triton launches (registers, spills)
* :mod:`helpers.web` -- the demo server's form defaults and a handle on a running ``python app.py``
* :mod:`helpers.context_parallel` -- what each gloo process of the context-parallel tests runs and compares
"""
