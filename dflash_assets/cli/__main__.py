import sys

from dflash_assets.cli import main

sys.exit(main())
