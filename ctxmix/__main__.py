import sys

from ctxmix.cli import main

sys.exit(main())
