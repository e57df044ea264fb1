import sys

from hpcrl_evaluate.cli import main

sys.exit(main())
