#!/usr/bin/env python
"""Gradio web demo of MHLA: ``python app.py [flags]`` (``python app.py --help``; same as ``mhla web``).

Text-to-video and class-to-image tabs, each able to run the same seed with MHLA and with the
original softmax attention side by side. Defaults to the embedded demonstration models.
"""

import sys

from mhla_diffusion.web import main

if __name__ == "__main__":
    sys.exit(main())
