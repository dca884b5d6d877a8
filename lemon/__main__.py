import sys

from lemon.cli import main

sys.exit(main())
