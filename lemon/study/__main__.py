import sys

from lemon.study.runner import main

sys.exit(main())
