"""`python -m gpuguard.config --reference | --shipped`: regenerate the generated files."""

import sys

from gpuguard.config.reference import _main

sys.exit(_main(sys.argv[1:]))
