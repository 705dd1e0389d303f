"""``python3 -m properties`` runs the ``mamba2-cutile`` command."""
import sys

from properties.cli import main

sys.exit(main())
