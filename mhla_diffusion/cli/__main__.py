"""``python -m mhla_diffusion.cli ...``: the ``mhla`` command without the installed script."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
