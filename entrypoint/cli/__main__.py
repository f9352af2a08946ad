"""``python -m entrypoint.cli ...``: the same CLI as the ``qwen38`` console script."""

from __future__ import annotations

import sys

from entrypoint.cli import main

sys.exit(main())
