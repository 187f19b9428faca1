"""`python -m turnrl ...` is the `turnrl` command."""

import sys

from turnrl.cli import main

sys.exit(main())
