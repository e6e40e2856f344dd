"""``mhla reproduce``: softmax attention, global linear attention and MHLA trained from scratch and compared (the
science experiment behind the README's "Attentions compared" section; not an embedded model).

* :mod:`.experiment`: the run (settings, stages, resume, budget) and its report;
* :mod:`.operators`: Part A, one attention layer fitted to fixed teachers (rank, controls);
* :mod:`.generative`: Part B, a small DiT denoiser trained on mirror-symmetric images per attention;
* :mod:`.statistics`: paired differences, Holm correction, intervals, minimal detectable differences;
* :mod:`.report` / :mod:`.docs`: the table, figures and calls from ``report.json``, and the README section and
  ``docs/reproduce.md`` written from them.

The command line is :mod:`mhla_diffusion.cli.reproduce`.
"""
