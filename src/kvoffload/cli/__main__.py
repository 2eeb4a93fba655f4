import sys

from kvoffload.cli import main

sys.exit(main())
