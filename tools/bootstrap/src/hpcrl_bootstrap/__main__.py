import sys

from hpcrl_bootstrap.cli import main

if __name__ == "__main__":
    sys.exit(main())
