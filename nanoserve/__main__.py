"""`python -m nanoserve run-batch ...`, the same as the `nanoserve` console script."""
import sys

from nanoserve.cli import main

if __name__ == "__main__":
    sys.exit(main())
