import sys

from peat_jax._src.cli import main

sys.exit(main())
